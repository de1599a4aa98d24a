"""The Strategy interface (modelled on Flower's strategies) and the plans it hands clients.

State is always ``dict[name -> tensor]`` keyed by the model's parameter names
(``...q_proj.lora_A.default.weight``); the server owns the single round loop and
calls these hooks, the client calls ``client_loss`` / ``after_step`` while training.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from fedllm.models.state import StateDict, cast, num_bytes

MAX_COUNT = 10**6
"""Largest integer a strategy argument (iterations, ranks, steps, periods) may hold; seeds are exempt."""


@dataclass
class Phase:
    """One stretch of local training: which parameters train, for how many steps."""

    keys: Optional[list[str]] = None  # trainable parameter names; None: every key of the plan's state
    steps: Optional[int] = None  # optimizer steps; None: the recipe's local_steps / local_epochs
    name: str = "local"


@dataclass
class ClientPlan:
    """What a client loads and trains this round (made by ``Strategy.configure_client``)."""

    client_id: int
    rnd: int
    state: StateDict  # written into the model before training
    phases: list[Phase] = field(default_factory=lambda: [Phase()])
    extra: dict[str, Any] = field(default_factory=dict)  # strategy-specific (control variates, anchors ...)
    lr: float = 0.0  # the round's learning rate, set by the server
    local: StateDict = field(default_factory=dict)  # client-held tensors (private factors ...): loaded, never sent
    client_state: StateDict = field(default_factory=dict)  # the client's stored per-client state (client side)


@dataclass
class ClientUpdate:
    """What a client sends back after local training."""

    client_id: int
    state: StateDict
    num_examples: int
    loss: Optional[float]  # the client's mean training loss; None: not uploaded (DP-SGD: no noise protects it)
    steps: int
    padding: tuple[int, int] = (0, 0)  # (padded positions, all positions) of the batches trained on
    wire_bytes: int | None = None  # bytes as sent when compressed (federation.compression); None: the state's
    packed: Any = None  # the compressed form a transport carries (federation.compression.upload); None: uncompressed
    work: dict[str, float] = field(default_factory=dict)  # fedllm.models.flops.TrainedWork: tokens, seconds
    arrival_s: float | None = None  # seconds from the round's start to the upload's arrival (Flower); None: training's


@dataclass
class ClientInfo:
    """A client as the strategy sees it at setup."""

    client_id: int
    num_examples: int


class Strategy(abc.ABC):
    """Base strategy: hooks with do-nothing defaults; FedAvg overrides ``aggregate``.

    Attributes:
        recipe: the run's :class:`fedllm.recipe.schema.Recipe`, set by the server before ``setup``.
        modifies_base: True when the strategy changes the frozen base weights (their current
            values are then checkpointed and exported).
        kept_in_base: True when the pieces returned by :meth:`kept_factors` are also merged into
            the current base weights already (FedLoRU's ``accumulate: merge``), so the original
            weight is the current base minus them; False when they are kept only beside the base.
        client_batching: True when clients can train together (``train.clients_per_pass``, see
            :mod:`fedllm.engine.batched_clients`): one default phase per plan, no ``after_step``, a
            ``client_loss`` that reads only ``model.named_parameters()``. It counts only when declared
            by the class that last overrode a client-side hook (:meth:`client_batching_problem`).
        aggregates_by_sum: True when :meth:`aggregate` needs only the (weighted) sum of the uploads: it returns
            the same when every upload is replaced by the round's mean upload (weighted by :meth:`sum_weight`,
            unweighted for :meth:`summed_unweighted` keys), so secure aggregation can run it on the unmasked sum
            (:meth:`aggregate_mean`). It counts only when declared by the class that last overrode
            ``aggregate`` (:meth:`sum_aggregation_problem`); :attr:`needs_individual_updates` says why not.
    """

    name = "base"
    modifies_base = False
    kept_in_base = False
    client_batching = False
    personalized = False
    aggregates_by_sum = False
    needs_individual_updates = "is not declared to aggregate from the sum of the uploads (Strategy.aggregates_by_sum)"

    def __init__(self, **kwargs: Any):
        if kwargs:
            raise TypeError(f"{self.name} takes no argument(s) {sorted(kwargs)}")
        self.recipe: Any = None

    @property
    def seed(self) -> int:
        """The run's seed (0 before a recipe is bound)."""
        return self.recipe.seed if self.recipe is not None else 0

    @property
    def comm_dtype(self) -> str:
        """The dtype tensors travel in (``federation.comm_dtype``)."""
        return self.recipe.federation.comm_dtype if self.recipe is not None else "fp32"

    #: Hooks that shape local training; a class overriding one must vouch for client batching itself.
    CLIENT_HOOKS = ("configure_client", "open_client", "close_client", "client_loss", "after_step",
                    "client_upload", "client_optimizer_state", "global_keys")

    @classmethod
    def client_batching_problem(cls) -> Optional[str]:
        """Why this strategy cannot train clients together (None when it can; see :attr:`client_batching`)."""
        mro = cls.__mro__
        flag_at = next(i for i, c in enumerate(mro) if "client_batching" in c.__dict__)
        hooks_at = min(next(i for i, c in enumerate(mro) if h in c.__dict__) for h in cls.CLIENT_HOOKS)
        if not mro[flag_at].__dict__["client_batching"]:
            return f"{cls.name} does not support client-batched training"
        if hooks_at < flag_at:
            return (f"{cls.name} changes the client side ({mro[hooks_at].__name__}) without declaring "
                    "client_batching = True")
        if cls.after_step is not Strategy.after_step:
            return f"{cls.name} corrects every local step (after_step), which batched training does not call"
        return None

    @classmethod
    def sum_aggregation_problem(cls) -> Optional[str]:
        """Why this strategy cannot aggregate from the sum of the uploads alone (None when it can; see
        :attr:`aggregates_by_sum`)."""
        mro = cls.__mro__
        flag_at = next(i for i, c in enumerate(mro) if "aggregates_by_sum" in c.__dict__)
        aggregate_at = next(i for i, c in enumerate(mro) if "aggregate" in c.__dict__)
        if not mro[flag_at].__dict__["aggregates_by_sum"]:
            return cls.needs_individual_updates
        if aggregate_at < flag_at:
            return (f"changes aggregate ({mro[aggregate_at].__name__}) without declaring "
                    "aggregates_by_sum = True")
        return None

    # ----- argument checking (used by recipe validation)
    @classmethod
    def check_args(cls, args: dict[str, Any]) -> list[tuple[str, Any, str]]:
        """Problems with ``args`` as ``(key, given, expected)``: unknown names and wrong types."""
        params = {n: p for n, p in inspect.signature(cls.__init__).parameters.items()
                  if n not in ("self", "kwargs") and p.kind is not p.VAR_KEYWORD}
        problems = []
        for key, value in args.items():
            if key not in params:
                problems.append((key, value, f"an argument of {cls.name}: {', '.join(params) or 'none'}"))
                continue
            default = params[key].default
            if isinstance(default, bool) and not isinstance(value, bool):
                problems.append((key, value, "true or false"))
            elif isinstance(default, (int, float)) and not isinstance(default, bool) and (
                    isinstance(value, bool) or not isinstance(value, (int, float))):
                problems.append((key, value, "a number"))
            elif isinstance(default, str) and not isinstance(value, str):
                problems.append((key, value, "a string"))
            elif "seed" not in key and any(isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_COUNT
                                           for v in (value if isinstance(value, list) else [value])):
                problems.append((key, value, f"counts of at most {MAX_COUNT:,} (a sane bound: more would run "
                                             "for ever or exhaust memory)"))
        problems.extend(cls.check_values(args))
        return problems

    @classmethod
    def check_values(cls, args: dict[str, Any]) -> list[tuple[str, Any, str]]:
        """Range checks of a subclass's arguments (override)."""
        return []

    # ----- hooks
    def setup(self, model: torch.nn.Module, clients: list[ClientInfo]) -> None:
        """Once, before round 1 (e.g. SVD init, per-client state)."""

    def global_keys(self, model: torch.nn.Module) -> list[str]:
        """Names of the parameters that form the global (aggregated) state."""
        return [n for n, p in model.named_parameters() if p.requires_grad]

    def configure_client(self, rnd: int, client_id: int, global_state: StateDict) -> ClientPlan:
        """What ``client_id`` loads and trains in round ``rnd``."""
        return ClientPlan(client_id=client_id, rnd=rnd, state=global_state)

    # ----- client side: run where the client's data and per-client state live
    def open_client(self, plan: ClientPlan) -> None:
        """Client side, before training: read ``plan.client_state`` (the client's stored entry, empty the
        first time) into the plan, e.g. private factors into ``plan.local`` or ``c_i`` into ``plan.extra``.

        Stored tensors may sit on the CPU (gathered from another process or read from disk): move them
        to the model's device before computing with them.
        """

    def close_client(self, plan: ClientPlan, trained: StateDict, steps: int) -> StateDict:
        """Client side, after training: the client's new stored entry (default: unchanged).

        Called before :meth:`client_upload`; what it returns stays with the client and is never sent.
        """
        return plan.client_state

    def client_loss(self, model: torch.nn.Module, plan: ClientPlan) -> Optional[torch.Tensor]:
        """Extra loss term added to each micro-batch (e.g. FedProx)."""
        return None

    def after_step(self, model: torch.nn.Module, plan: ClientPlan) -> None:
        """Called after every local optimizer step (e.g. SCAFFOLD's correction)."""

    def client_upload(self, plan: ClientPlan, trained: StateDict, steps: int) -> StateDict:
        """What the client sends: by default the trained values of the plan's state keys."""
        return {k: trained[k] for k in plan.state}

    def client_optimizer_state(self, rnd: int, client_id: int,
                               state: Optional[StateDict]) -> Optional[StateDict]:
        """The per-client optimizer moments ``client_id`` continues from in round ``rnd``.

        Called once per sampled client per round with the moments kept from its last round
        (None when moments are reset each round); a strategy that re-initialises tensors drops
        their stale moments here. Default: unchanged.
        """
        return state

    def download_bytes(self, plan: ClientPlan, comm_dtype: str) -> int:
        """Bytes sent to a sampled client this round."""
        return num_bytes(plan.state, comm_dtype)

    def extra_download_bytes(self, rnd: int, sampled: list[int], num_clients: int, comm_dtype: str) -> dict[int, int]:
        """Bytes sent to clients outside ``configure_client`` (e.g. syncs to non-participants)."""
        return {}

    @abc.abstractmethod
    def aggregate(self, rnd: int, global_state: StateDict, updates: list[ClientUpdate]) -> StateDict:
        """The new global state from the round's updates."""

    def sum_weight(self, update: ClientUpdate) -> int:
        """The integer weight a client multiplies its upload by under secure aggregation (default 1)."""
        return 1

    def summed_unweighted(self, key: str) -> bool:
        """True for an upload key summed without the client's weight (e.g. SCAFFOLD's control-variate change)."""
        return False

    def aggregate_mean(self, rnd: int, global_state: StateDict, mean: StateDict,
                       clients: list[ClientUpdate]) -> StateDict:
        """The new global state from the round's mean upload alone (secure aggregation): :meth:`aggregate` with
        every one of ``clients`` (the summed clients: ids, example counts; their states unknown) carrying
        ``mean`` — the weighted mean upload on weighted keys, the plain mean on the others. Equal to
        :meth:`aggregate` of the real uploads when :attr:`aggregates_by_sum` holds."""
        return self.aggregate(rnd, global_state, [dataclasses.replace(u, state=dict(mean)) for u in clients])

    def after_aggregate(self, rnd: int, model: torch.nn.Module, global_state: StateDict) -> StateDict:
        """After aggregation, with the model at hand (merge into the base, re-init ...)."""
        return global_state

    after_aggregate_reads_download = False
    """True when ``after_aggregate`` reads :attr:`downloaded` (FRLoRA's merge): a Flower node replaying it is sent the
    round's compressed download too."""

    downloaded: StateDict | None = None
    """The round's global state as its clients received it when the download is compressed
    (``federation.compression.download``: the dequantised values, set by the round loop for ``aggregate`` and
    ``after_aggregate``); None when every tensor travels as the state cast to ``federation.comm_dtype``."""

    def received(self, global_state: StateDict) -> StateDict:
        """``global_state`` (the round's, before aggregation) as every client of the round received it: the
        dequantised download (:attr:`downloaded`) of each tensor that travelled compressed, every other rounded
        through ``federation.comm_dtype`` (FedOpt's ``θ_sent``, the factors FRLoRA's clients started from)."""
        sent = cast(global_state, self.comm_dtype)
        if self.downloaded:
            sent.update({k: self.downloaded[k].to(v.device, v.dtype) for k, v in sent.items() if k in self.downloaded})
        return sent

    def exact_download_keys(self) -> frozenset[str]:
        """Global state keys that travel uncompressed under a compressed download (``federation.compression``):
        tensors a client receives once and keeps fixed, which must be the server's own values bit for bit (Fed-SB's
        ``A`` and ``B``). Default: none."""
        return frozenset()

    def reinitialised_at(self, rnd: int) -> list[str]:
        """Global state keys that ``after_aggregate`` of round ``rnd`` set to a newly drawn or derived value (a
        re-initialised factor): the server drops their download residual (``federation.compression``: the error
        of a value that no longer exists is not sent into its successor). Default: none."""
        return []

    def kept_factors(self) -> dict[str, list[tuple[torch.Tensor, torch.Tensor, float]]]:
        """Low-rank pieces of the learned update kept outside the adapter, for exact export.

        Maps a LoRA-wrapped module name (as in ``fedllm.models.loading.lora_layers``) to a list of
        ``(B, A, scale)``: the layer's learned change equals the sum of ``scale * B @ A`` over the
        list plus the current adapter's product (FedLoRU's accumulated factors). Default: none.
        See :attr:`kept_in_base` for whether the current base weights already include them.
        """
        return {}

    def base_residuals(self) -> dict[str, torch.Tensor]:
        """Dense changes of LoRA-wrapped base weights kept beside them instead of merged, for export.

        Maps a module name (as in ``fedllm.models.loading.lora_layers``) to an fp32 ``out × in`` matrix that
        the model adds to that layer's base weight (a forward hook computes with it): FRLoRA's and
        FedLoRU's merges on a 4/8-bit or half-precision base. Default: none.
        """
        return {}

    training_data: Optional[tuple[list[dict], Any, Any]] = None
    """``(examples, collate, loss)`` — every client's tokenized training examples, the function that batches them and
    ``loss(model, batch)``, the training loss of a batch (``train.objective``) — set by :func:`fedllm.engine.server.build_federation` before :meth:`setup` in a job that trains; None where
    setup runs without the data (export, dry run). Read only by a setup that needs examples (Fed-SB's init)."""

    resample_on_drops = True
    """Whether a round with too few valid updates may be tried again with a fresh sample
    (``federation.round_retries``); not under client-level DP, where which clients failed would pick the second
    sample."""

    late_update = ("dropped from its round as a failed client is: its upload is not aggregated, its per-client state "
                   "stays as it was before the round, and its next round starts from the global state of then")
    """What a client whose upload misses its round's deadline (``federation.round_deadline``) means for this
    strategy, in one sentence (``--dry-run`` prints it; docs/flower.md, "A round deadline")."""

    late_update_problem: Optional[str] = None
    """Why this strategy cannot run with ``federation.round_deadline`` (None: it can); the recipe is refused with it."""

    buffered_async = False
    """True on a class (its own attribute, not inherited: a subclass changes what aggregation means) whose
    aggregation FedBuff's buffered server step is defined for (``federation.mode: async``,
    :mod:`fedllm.engine.fedbuff`): the mean of the clients' model changes, then the server's step."""

    async_refusal = ("aggregates more than the mean of the clients' model changes, and FedBuff (Nguyen et al. 2022) is "
                     "defined for FedAvg and the FedOpt server optimisers (fedavg, fedavgm, fedadam, fedyogi, "
                     "fedadagrad)")
    """Why this strategy cannot run with ``federation.mode: async`` (the recipe is refused with it)."""

    @classmethod
    def async_problem(cls) -> Optional[str]:
        """Why ``federation.mode: async`` is refused for this strategy, or None when it can run asynchronously."""
        return None if cls.__dict__.get("buffered_async", False) else cls.async_refusal

    def outlier_scale(self) -> Optional[float]:
        """A data-independent norm that ``federation.update_outlier_factor`` multiplies to bound each update's norm
        (client-level DP: the clipping norm), or None: the median of the round's other updates (and the previous
        round's accepted ones), which lets one client's data decide whether another's update is summed."""
        return None

    def released_loss(self, loss: float) -> Optional[float]:
        """Client side: the training loss the client uploads with its update (None: none; DP-SGD's is not noised)."""
        return loss

    def uploads_seen(self, rnd: int, steps: dict[int, int]) -> None:
        """Server side: ``{client: local steps}`` of every upload that reached the server in round ``rnd`` —
        aggregated, dropped by the checks or the norm screen, or discarded with a retried sample alike (each was
        trained and seen: DP-SGD's accountant counts its steps)."""

    def sampling_seed(self, seed: int) -> int:
        """The seed each round's client sample is drawn from (``fedllm.engine.server.sample_clients``), given the
        recipe's ``seed``: that seed itself; client-level DP replaces it with a secret one (its ε assumes nobody
        outside the server can tell which clients were sampled)."""
        return seed

    def round_problem(self, rnd: int) -> Optional[str]:
        """Why round ``rnd`` must not run (the run then stops with a checkpoint of the round before), or None
        (e.g. a privacy budget that the round would exceed)."""
        return None

    def round_record(self, rnd: int) -> dict[str, Any]:
        """Entries added to round ``rnd``'s line of ``metrics.jsonl`` after it aggregated (e.g. the ε spent)."""
        return {}

    def sample_level_privacy(self, plan: ClientPlan, num_examples: int) -> Any:
        """Client side: the DP-SGD trainer the client of ``plan`` (``num_examples`` examples) trains with this
        round, or None (plain training); see :mod:`fedllm.privacy.dp_sgd`."""
        return None

    def personal_state(self, client_id: int, client_state: StateDict) -> Optional[StateDict]:
        """A personalized strategy's tensors that turn the global model into client ``client_id``'s own
        (loaded for its eval and export), from its stored entry ``client_state`` (empty if it never trained)."""
        return None

    def state_dict(self) -> StateDict:
        """Server-side tensors to checkpoint (server moments, the server control variate ...); per-client
        state is not here but in the client store."""
        return {}

    def load_state_dict(self, state: StateDict) -> None:
        """Restore what :meth:`state_dict` returned."""
