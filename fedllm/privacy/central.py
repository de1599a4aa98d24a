"""Client-level differential privacy around a strategy whose upload is a model delta.

DP-FedAvg (McMahan et al. 2018, "Learning Differentially Private Recurrent Language Models"): each sampled
client's change ``δ_k = θ_k − θ_sent`` (over every tensor it uploads) is clipped to L2 norm ``C`` — by the server
(``privacy.mechanism: central``) or by the client before it uploads (``central_client_clipping``) — and the
server releases ``θ_sent + (Σ_k clip(δ_k) + N(0, (z·C)²)) / m`` with ``m`` the clients sampled per round (a fixed
denominator: a dropped client does not raise the sensitivity). Adaptive clipping (Andrew et al. 2021,
"Differentially Private Learning with Adaptive Clipping") moves ``C`` toward the ``γ`` quantile of the update
norms, ``C ← C·exp(−η·(b̃ − γ))`` with ``b̃`` the noised fraction of unclipped updates; the count noise
``σ_b`` and the update noise ``z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2)`` together cost what one Gaussian of multiplier
``z`` costs — because the count released is of centred bits, ``Σ_k (b_k − ½) + N(0, σ_b²)`` (Andrew et al.,
Alg. 1; TF Privacy's ``QuantileEstimatorQuery``), which one client moves by at most ½, and
``b̃ = (that)/m + ½`` (:func:`noised_unclipped_fraction`).

The wrapped strategy aggregates the private mean: every update handed to it is ``θ_sent + (n/m)·clip(δ_k) +
noise`` (the same noise in each, uniform weights), so a mean-of-uploads strategy computes exactly the noised
mean, and its server optimiser, merges and re-inits are post-processing. With the same updates and noise this
equals Flower's ``DifferentialPrivacyServerSideFixedClipping`` / ``ClientSideFixedClipping`` around a uniform
FedAvg (tests/privacy). The noise comes from a 256-bit secret drawn once per run (and shared by every process of a
multi-process run), unless ``privacy.noise_seed`` fixes it; each round's draws are ChaCha20 streams keyed by that
secret, the round and the tensor's name (:mod:`fedllm.privacy.secret_streams`), so nobody can grind a seed out of
released models, and a resume recomputes round ``t``'s noise from the secret alone. So does the client sample
(:meth:`ClientLevelDP.sampling_seed`): the amplified ε assumes the sampled clients are secret, so the sample is not
drawn from the recipe's ``seed``, which every export's card and recipe state, but from a second secret, kept with
the noise secret in the strategy's checkpointed state (a resume continues the same samples) and never written to an
export.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Optional

import torch

from fedllm.common.errors import InputError
from fedllm.models.state import StateDict, cast
from fedllm.privacy import accounting, secret_streams
from fedllm.strategies.base import ClientPlan, ClientUpdate

NORM_KEY = "dp_clipping_norm"
"""``plan.extra`` entry: the norm a client clips its update to (``central_client_clipping``)."""
UNCLIPPED_KEY = "fedllm.privacy.unclipped"
"""Upload entry with adaptive client-side clipping: 1.0 when the client's update was within the norm."""
STATE_PREFIX = "privacy/"
SECRETS = ("noise_secret", "sampling_secret")
"""The checkpointed secrets (``privacy/<name>``: 32 uint8, or empty before it is drawn)."""

log = logging.getLogger("fedllm")


def _secret_tensor(secret: bytes | None) -> torch.Tensor:
    return torch.tensor(list(secret or b""), dtype=torch.uint8)


def _legacy_secret(state: dict[str, torch.Tensor], name: str) -> bytes | None:
    """A checkpoint of an older fedllm holds a 63-bit integer seed (``-1``: not drawn): resumed with it, hashed."""
    seed = int(state.get(name, torch.tensor(-1)))
    if seed < 0:
        return None
    log.warning("privacy: resuming a checkpoint of an older fedllm whose %s is a 63-bit integer: the run continues "
                "from it (its noise and sample stay only as secret as that seed); a new run draws 256 bits", name)
    return secret_streams.secret_of_seed(seed)


def l2_norm(tensors: StateDict) -> float:
    """L2 norm of every tensor together (fp64)."""
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors.values()))


def adaptive_noise(noise_multiplier: float, count_stddev: float) -> float:
    """Andrew et al.'s update noise multiplier ``(z⁻² − (2σ_b)⁻²)^(−1/2)`` (Flower's compute_adaptive_noise_params)."""
    return (noise_multiplier ** -2 - (2 * count_stddev) ** -2) ** -0.5


def centred_count(unclipped: list[bool]) -> float:
    """``Σ_k (b_k − ½)``: the count the adaptive norm releases; adding or removing one client moves it by ½, the
    sensitivity the budget split of :func:`adaptive_noise` assumes (a plain count moves by 1: twice the ε)."""
    return sum(float(b) - 0.5 for b in unclipped)


def noised_unclipped_fraction(noised_centred: float, expected: int) -> float:
    """``b̃``: the fraction of unclipped updates estimated from the noised centred count over ``expected`` clients."""
    return noised_centred / expected + 0.5


class ClientLevelDP:
    """Mixin before a strategy class: clipping, noise, adaptive norm and accounting (see the module docstring).

    Built by :func:`fedllm.privacy.with_privacy`; ``bind_privacy`` reads the recipe's ``privacy`` section.
    """

    def bind_privacy(self, recipe: Any) -> None:
        pv, fed = recipe.privacy, recipe.federation
        self.pv = pv
        self.population, self.expected = fed.num_clients, recipe.sampled_per_round()
        self.accounting = accounting.resolved(pv.accounting, self.population, self.expected)
        self.noise_multiplier = pv.noise_multiplier if pv.noise_multiplier is not None else \
            accounting.central_noise_multiplier(self.accounting, pv.target_epsilon, pv.delta, self.population,
                                                self.expected, fed.rounds)
        self.clip_on_server = pv.mechanism == "central"
        self.clipping_norm = float(pv.clipping_norm)
        ac = pv.adaptive_clipping
        self.count_stddev = (ac.count_stddev if ac.count_stddev is not None else self.expected / 20) \
            if ac.enabled else 0.0
        if ac.enabled and self.noise_multiplier >= 2 * self.count_stddev:
            raise InputError(f"{recipe.source}: privacy.adaptive_clipping.count_stddev: got {self.count_stddev:g}; "
                             f"expected more than noise_multiplier / 2 = {self.noise_multiplier / 2:.4g} (the noise "
                             f"multiplier privacy.target_epsilon needs); the count noise spends part of the budget")
        self.update_noise = adaptive_noise(self.noise_multiplier, self.count_stddev) if ac.enabled and \
            self.count_stddev > 0 else self.noise_multiplier
        self.releases = 0
        fixed = None if pv.noise_seed is None else secret_streams.secret_of_seed(pv.noise_seed)
        self.noise_secret: bytes | None = fixed  # drawn on the first aggregation when not fixed
        self.sampling_secret: bytes | None = fixed  # drawn on the first sample (sampling_seed)
        self.last: dict[str, Any] = {}

    resample_on_drops = False  # a retry's sample would depend on which clients failed: not a noised release

    def outlier_scale(self) -> Optional[float]:
        """The outlier screen bounds each update by ``update_outlier_factor`` × the current clipping norm (set by the
        recipe or by earlier noised releases): whether a client is summed depends on its own update alone."""
        return self.clipping_norm

    def sampling_seed(self, seed: int) -> bytes:
        """The 256-bit secret the client samples are drawn from (:func:`fedllm.engine.server.sample_clients` with
        bytes: ChaCha20), drawn from the OS once per run (the same on every process of a multi-process run); derived
        from ``privacy.noise_seed`` when that is set (experiments: reproducible, and as public as the noise). The
        recipe's ``seed`` is not used: it is in every export's card."""
        if self.sampling_secret is None:
            self.sampling_secret = secret_streams.new_secret()
        return self.sampling_secret

    # ----- accounting
    def epsilon_after(self, releases: int) -> float:
        """ε at ``privacy.delta`` after ``releases`` noised aggregates."""
        return accounting.central_epsilon(self.accounting, self.noise_multiplier, self.population, self.expected,
                                          releases, self.pv.delta)

    def round_problem(self, rnd: int) -> Optional[str]:
        if self.pv.target_epsilon is None:
            return None
        eps = self.epsilon_after(self.releases + 1)
        if eps > self.pv.target_epsilon * (1 + 1e-9):
            return (f"the privacy budget is spent: aggregating round {rnd} would bring epsilon to {eps:.4g} > "
                    f"privacy.target_epsilon = {self.pv.target_epsilon:g} (delta {self.pv.delta:g})")
        return None

    def round_record(self, rnd: int) -> dict[str, Any]:
        return {"epsilon": self.last.get("epsilon", self.epsilon_after(self.releases)),
                "privacy": {"mechanism": self.pv.mechanism, "delta": self.pv.delta,
                            "noise_multiplier": self.noise_multiplier, "accounting": self.accounting,
                            "releases": self.releases, **{k: v for k, v in self.last.items() if k != "epsilon"}}}

    # ----- client side (central_client_clipping)
    def released_loss(self, loss: float) -> Optional[float]:
        """Nothing unless ``privacy.per_client_stats``: the loss is a function of the client's data beside a noised
        release (:mod:`fedllm.privacy.client_stats`)."""
        return super().released_loss(loss) if self.pv.per_client_stats else None

    def configure_client(self, rnd: int, client_id: int, global_state: StateDict) -> ClientPlan:
        plan = super().configure_client(rnd, client_id, global_state)
        if not self.clip_on_server:
            plan.extra[NORM_KEY] = float(self.clipping_norm)
        return plan

    def client_upload(self, plan: ClientPlan, trained: StateDict, steps: int) -> StateDict:
        up = super().client_upload(plan, trained, steps)
        if self.clip_on_server:
            return up
        adaptive = self.pv.adaptive_clipping.enabled
        if any(v.is_meta for v in up.values()):  # the layout probe of fedllm.engine.client_faults
            return {**up, **({UNCLIPPED_KEY: torch.empty(1, device="meta")} if adaptive else {})}
        norm_to = float(plan.extra.get(NORM_KEY, self.clipping_norm))
        delta = {k: v.float() - plan.state[k].to(v.device).float() for k, v in up.items()}
        norm = l2_norm(delta)
        factor = min(1.0, norm_to / norm) if norm > 0 else 1.0
        out = {k: (plan.state[k].to(v.device).float() + factor * delta[k]).to(v.dtype) for k, v in up.items()}
        if adaptive:
            out[UNCLIPPED_KEY] = torch.tensor([float(norm <= norm_to)])
        return out

    # ----- secure aggregation: the server step above needs only the sum of the uploads (with client clipping)
    def sum_weight(self, update: ClientUpdate) -> int:
        """Uniform: the DP mean divides the sum of clipped changes by m, whatever a client's size."""
        return 1

    def summed_unweighted(self, key: str) -> bool:
        return key == UNCLIPPED_KEY or super().summed_unweighted(key)

    # ----- server side
    @staticmethod
    def gaussian(key: bytes, shape: tuple[int, ...], std: float) -> torch.Tensor:
        """``N(0, std²)`` noise of ``shape`` (fp32, CPU) from the stream of ``key`` (tests substitute Flower's numpy
        draws, in the order of the calls: the count's noise, then each tensor's)."""
        return secret_streams.gaussian(key, tuple(shape), std)

    def noise_key(self, rnd: int, *name: str) -> bytes:
        """The key of round ``rnd``'s noise of tensor ``name`` (none: the count's), drawn from the secret alone."""
        if self.noise_secret is None:
            self.noise_secret = secret_streams.new_secret()
        return secret_streams.stream_key(self.noise_secret, "central-dp", rnd, *(name or ("count",)))

    def reference(self, rnd: int, client_id: int, global_state: StateDict) -> StateDict:
        """What the client started from (its plan's state as the wire carried it)."""
        return cast(super().configure_client(rnd, client_id, global_state).state, self.comm_dtype)

    def aggregate(self, rnd: int, global_state: StateDict, updates: list[ClientUpdate]) -> StateDict:
        if not updates:
            return super().aggregate(rnd, global_state, updates)
        norm, m = self.clipping_norm, self.expected
        kept, within_norm = [], []
        for u in updates:
            state = dict(u.state)
            bit = state.pop(UNCLIPPED_KEY, None)
            ref = self.reference(rnd, u.client_id, global_state)
            delta = {k: v.float() - ref[k].to(v.device).float() for k, v in state.items()}
            size = l2_norm(delta)
            if self.clip_on_server:
                factor, within = (min(1.0, norm / size) if size > 0 else 1.0), size <= norm
            else:
                # the client's bit; under secure aggregation each update carries the round's mean bit (a fraction),
                # whose sum over the updates is the count of unclipped updates all the same
                factor, within = 1.0, 1.0 if bit is None else float(bit.flatten()[0])
            within_norm.append(within)
            kept.append((u, ref, delta, factor))
        noised_centred = centred_count(within_norm) + (float(self.gaussian(self.noise_key(rnd), (), self.count_stddev))
                                                        if self.count_stddev else 0.0)
        std = self.update_noise * norm / m
        first = kept[0][2]
        noise = {k: self.gaussian(self.noise_key(rnd, "tensor", k), tuple(v.shape), std).to(v.device)
                 for k, v in first.items()}
        scale = len(updates) / m
        private = [dataclasses.replace(u, num_examples=1, state={
            k: (ref[k].to(d.device).float() + (scale * factor) * d + noise[k]).to(u.state[k].dtype)
            for k, d in delta.items()}) for u, ref, delta, factor in kept]
        out = super().aggregate(rnd, global_state, private)
        self.releases += 1
        self.last = {"clipping_norm": norm, "noise_std": std, "unclipped": float(sum(within_norm)),
                     "epsilon": self.epsilon_after(self.releases)}
        if self.pv.adaptive_clipping.enabled:
            ac = self.pv.adaptive_clipping
            fraction = noised_unclipped_fraction(noised_centred, m)
            self.clipping_norm = norm * math.exp(-ac.learning_rate * (fraction - ac.target_quantile))
        return out

    def state_dict(self) -> StateDict:
        return {**super().state_dict(),
                f"{STATE_PREFIX}clipping_norm": torch.tensor(self.clipping_norm, dtype=torch.float64),
                f"{STATE_PREFIX}releases": torch.tensor(self.releases, dtype=torch.int64),
                **{f"{STATE_PREFIX}{name}": _secret_tensor(getattr(self, name)) for name in SECRETS}}

    def load_state_dict(self, state: StateDict) -> None:
        mine = {k[len(STATE_PREFIX):]: v for k, v in state.items() if k.startswith(STATE_PREFIX)}
        super().load_state_dict({k: v for k, v in state.items() if not k.startswith(STATE_PREFIX)})
        if mine:
            self.clipping_norm = float(mine["clipping_norm"])
            self.releases = int(mine["releases"])
            for name, legacy in zip(SECRETS, ("noise_seed", "sampling_seed"), strict=True):
                if name in mine:
                    setattr(self, name, bytes(mine[name].tolist()) or None)
                else:  # an older checkpoint: its integer seed (a sampling seed absent from older still: drawn anew)
                    setattr(self, name, _legacy_secret(mine, legacy))
