"""Server optimisers on the pseudo-gradient (Reddi et al., 2021): the maths FedAvgM, FedAdagrad, FedYogi
and FedAdam share.

Each round the clients' weighted mean ``θ̄`` (FedAvg's aggregation) gives the pseudo-gradient
``Δ = θ̄ − θ_sent``, where ``θ_sent`` is θ as the clients received it (rounded through
``federation.comm_dtype``, or the dequantised download under ``federation.compression.download``,
:meth:`fedllm.strategies.base.Strategy.received`): the clients start from ``θ_sent``, so measuring their progress
against the unrounded θ would count the transport's rounding or quantisation as progress and drift the moments
even when no client learns anything (with fp32 transport ``θ_sent = θ``). The server's θ itself stays exact; what
a compressed download dropped is sent in a later round by the server's error-feedback residual. The step is added to the server's own θ. A subclass updates its keyed moments from ``Δ`` and returns the step added to ``θ``.
The update rules and defaults are Flower's strategies of the same names (``flwr.serverapp.strategy``),
so ``eta``, ``beta_1``, ``beta_2`` and ``tau`` mean what they mean there. The moments are server state:
:meth:`ServerOptimizer.state_dict` holds them (``<moment>/<param name>``), checkpointed and restored on
resume. Moments and steps are computed in fp32 and the new state is cast back to each tensor's dtype.
"""

from __future__ import annotations

import abc

import torch

from fedllm.models.state import StateDict, check_same_keys
from fedllm.strategies.base import ClientUpdate
from fedllm.strategies.fedavg import FedAvg


class ServerOptimizer(FedAvg, abc.ABC):
    """FedAvg's weighted mean, then a server optimiser step on ``Δ = θ̄ − θ_sent`` (see the module docstring).

    Args:
        eta: server learning rate η.
        beta_1: first-moment decay β1 (``m ← β1·m + (1 − β1)·Δ``).
        beta_2: second-moment decay β2.
        tau: adaptivity τ added to ``√v``.
        weighting: as FedAvg (``examples`` or ``uniform``).
    """

    aggregates_by_sum = True  # FedAvg's weighted mean, then a step of server state from it

    def __init__(self, eta: float = 0.1, beta_1: float = 0.0, beta_2: float = 0.0, tau: float = 1e-3,
                 weighting: str = "examples", **kwargs):
        super().__init__(weighting=weighting, **kwargs)
        self.eta, self.beta_1, self.beta_2, self.tau = float(eta), float(beta_1), float(beta_2), float(tau)
        self.moments: dict[str, StateDict] = {}

    @classmethod
    def check_values(cls, args):
        problems = super().check_values(args)
        for key in ("beta_1", "beta_2", "server_momentum"):
            if key in args and isinstance(args[key], (int, float)) and not 0 <= args[key] < 1:
                problems.append((key, args[key], "a number in [0, 1)"))
        for key in ("eta", "tau", "server_learning_rate"):
            if key in args and isinstance(args[key], (int, float)) and not args[key] > 0:
                problems.append((key, args[key], "a positive number"))
        return problems

    def moment(self, name: str, delta: StateDict) -> StateDict:
        """The moment ``name`` keyed like ``delta`` (zeros before the first round)."""
        if name not in self.moments:
            self.moments[name] = {k: torch.zeros_like(v) for k, v in delta.items()}
        check_same_keys(self.moments[name], delta, f"moment {name!r} and the pseudo-gradient")
        return {k: v.to(delta[k].device) for k, v in self.moments[name].items()}

    def first_moment(self, delta: StateDict) -> StateDict:
        """``m ← β1·m + (1 − β1)·Δ`` (stored and returned)."""
        m = self.moment("m", delta)
        self.moments["m"] = {k: self.beta_1 * m[k] + (1 - self.beta_1) * delta[k] for k in delta}
        return self.moments["m"]

    def adaptive_step(self, eta: float, m: StateDict, v: StateDict) -> StateDict:
        """``η·m / (√v + τ)``, key by key."""
        return {k: eta * m[k] / (v[k].sqrt() + self.tau) for k in m}

    @abc.abstractmethod
    def server_step(self, rnd: int, delta: StateDict) -> StateDict:
        """Update the moments from the pseudo-gradient ``delta`` and return the step added to θ."""

    def aggregate(self, rnd: int, global_state: StateDict, updates: list[ClientUpdate]) -> StateDict:
        mean = super().aggregate(rnd, global_state, updates)
        check_same_keys(mean, global_state, "aggregate and global state")
        sent = self.received(global_state)  # what every client started from (comm_dtype or the dequantised download)
        step = self.server_step(rnd, {k: mean[k].float() - sent[k].float() for k in mean})
        return {k: (global_state[k].float() + step[k]).to(global_state[k].dtype) for k in global_state}

    def state_dict(self) -> StateDict:
        return {f"{name}/{k}": v for name, moment in sorted(self.moments.items()) for k, v in moment.items()}

    def load_state_dict(self, state: StateDict) -> None:
        self.moments = {}
        for key, value in state.items():
            name, param = key.split("/", 1)
            self.moments.setdefault(name, {})[param] = value.clone()
