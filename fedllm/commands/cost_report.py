"""What a recipe costs, computed from the model's shapes and fedllm's own strategy accounting.

Works the same on a real model and on one built on the meta device from its config
(:mod:`fedllm.models.info`): every figure is a function of parameter shapes and dtypes,
of the strategy's hooks (``configure_client``, ``download_bytes``, ``client_upload``,
``extra_download_bytes``, ``state_dict``) and of the recipe. ``fedllm train RECIPE --dry-run``
prints it; the paper tests (tests/meta/) compare it with the papers' tables.

Peak memory of one training process (formula printed with the report)::

    weights + trainable + gradients + optimizer moments + strategy state + base changes + activations
    activations = b·s·L·p·(4h + 3·d_q + 2·d_kv + 4i) + b·s·V·(p + 8)

``b`` micro-batch, ``s`` max_length (every sequence taken at full length: an upper bound), ``L``
layers, ``h`` hidden size, ``d_q``/``d_kv`` query and key/value widths, ``i`` MLP width, ``V``
vocabulary (causal LMs), ``p`` bytes of the compute dtype. The per-token term counts the tensors
a pre-norm transformer block saves for backward with fused (SDPA) attention: the two norm inputs and
outputs (4h), q, attention output and SDPA output (3·d_q), k and v (2·d_kv), and the MLP's gate, up,
activation and product (4i); the last term is the logits in the compute dtype plus their fp32 copy
and its gradient. No gradient checkpointing (fedllm does not use it).

Where training runs the LM head fused with its cross-entropy (:mod:`fedllm.models.fused_head_loss`: the loss at the
supervised positions of a frozen plain head), no ``b·s x V`` logits exist: a chunk of at most ``c`` rows does
(``c`` = :func:`~fedllm.models.fused_head_loss.chunk_rows` of ``V``, about 32 MiB of fp32 logits), beside the
gradient with respect to the hidden states it keeps, so the last term becomes ``min(b·s, c)·V·(p + 8) + b·s·h·p``.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

from fedllm.engine.activation_memory import unquantised_fp32
from fedllm.recipe.schema import Recipe
from fedllm.runs.comm_budget import MB

GB = 1024**3
"""Bytes per GB in the memory estimate (and the fits line's card sizes)."""

#: Bytes per parameter of a bitsandbytes-quantised linear weight: 8-bit (int8 + an fp32 scale per
#: output row, added separately) and 4-bit NF4 with double quantisation (4 bits, an 8-bit absmax per
#: block of 64, an fp32 second-level absmax per 256 blocks); FlowerTune's FP4 (4 bits, an fp32 absmax per block of 64).
QUANT_BYTES = {"8bit": 1.0, "4bit": 0.5 + 1 / 64 + 4 / (64 * 256), "4bit-flowertune": 0.5 + 4 / 64}
#: Modules bitsandbytes leaves unquantised (transformers skips the output head).
UNQUANTISED_HEADS = ("lm_head", "score", "classifier")
#: A CPU training process's memory beside the tensors and the tokenizer: the data, Python's objects (measured: 53 MiB
#: after SmolLM2-135M's federation was built, above its weights, of which its tokenizer 31; docs/memory.md). A GPU's
#: is the CUDA context (:data:`fedllm.commands.memory_fit.CUDA_RUNTIME_BYTES`).
CPU_RUNTIME_BYTES = 22 * 2**20
#: A CPU process under ``train.compile``: the compiler's memory outside torch's allocator at the step's peak. Measured
#: for SmolLM2-135M against the eager run at the same shapes (bench/memory_bound.py's RSS peak less torch's allocator
#: peak, read through the profiler): 67 and 77 MiB where the step peaks at the first backward, whose graph is compiled
#: while the forward's activations are all held (4 x 256, fp32 and bf16), 12 MiB checkpointed (2 x 512), where the
#: head's chunk sets the peak (docs/memory.md). On a GPU it is host memory, outside the estimate.
CPU_COMPILER_BYTES = 64 * 2**20
#: A fast tokenizer's resident bytes per byte of its compact serialised form (``backend_tokenizer.to_str()``): 21.2
#: measured for both SmolLM2-135M's (1.49 MB serialised, 31.6 MiB resident) and Gemma 3 270M's (13.7 MB, 290 MiB).
TOKENIZER_BYTES_PER_SERIALISED_BYTE = 21.2
#: Without the tokenizer (the meta device), resident bytes per vocabulary entry: the larger of the two measured
#: (Gemma 3 270M's 262,144 entries: 1,180; SmolLM2-135M's 49,152: 646).
TOKENIZER_BYTES_PER_ENTRY = 1180
#: Terms of the peak-memory estimate printed only when not zero.
OPTIONAL_TERMS = ("backward", "base changes", "residual casts", "dequantised weight", "fp32 blocks", "runtime",
                  "compiler")
LORA_PARTS = re.compile(r"\.(lora_[AB]|lora_embedding_[AB]|lora_magnitude_vector)\.[^.]+")
SUFFIXES = (".base_layer", ".modules_to_save.default", ".original_module")


def module_type(param_name: str) -> str:
    """``base_model.model.model.layers.7.self_attn.q_proj.lora_A.default.weight`` -> ``self_attn.q_proj``."""
    name = param_name.removeprefix("base_model.model.")
    name = re.sub(r"^(model|roberta|bert|transformer)\.", "", name)
    name = re.sub(r"(^|\.)(layers|layer|h|blocks)\.\d+\.", r"\1", name)
    name = LORA_PARTS.sub("", name)
    for s in SUFFIXES:
        name = name.replace(s, "")
    return name.rsplit(".", 1)[0] if "." in name else name


def logical_numel(p: Any) -> int:
    """Parameters a tensor stands for (a packed 4-bit weight holds two per byte)."""
    state = getattr(p, "quant_state", None)
    if state is not None and getattr(state, "shape", None) is not None:
        return int(math.prod(state.shape))
    return p.numel()


def _quantised(name: str, module: Any, quantization: str) -> bool:
    return (quantization != "none" and type(module).__name__ in ("Linear", "Linear8bitLt", "Linear4bit")
            and not any(h in name.split(".") for h in UNQUANTISED_HEADS))


@dataclass
class ParamRow:
    """Parameters of one module type (summed over layers)."""

    name: str
    count: int = 0  # modules of this type
    trainable: int = 0
    frozen: int = 0
    frozen_bytes: float = 0.0


def parameter_rows(model: Any, quantization: str = "none", on_meta: bool = False,
                   trained: frozenset[str] = frozenset()) -> list[ParamRow]:
    """Trainable and frozen parameters per module type, with the frozen weights' bytes as loaded.

    A parameter is trainable when it requires grad or is named in ``trained`` (e.g. the strategy's global
    keys: FedLoRA-PFL's shared full weights train in a phase of their own).

    On the meta device the bytes of a quantised recipe are computed with :data:`QUANT_BYTES`;
    on a real model they are the tensors' own bytes.
    """
    rows: "OrderedDict[str, ParamRow]" = OrderedDict()
    seen_modules: dict[str, set[str]] = {}
    owners = {}
    for mod_name, module in model.named_modules():
        for p_name, _ in module.named_parameters(recurse=False):
            owners[f"{mod_name}.{p_name}" if mod_name else p_name] = (mod_name, module)
    for name, p in model.named_parameters():
        kind = module_type(name)
        row = rows.setdefault(kind, ParamRow(kind))
        mod_name, module = owners[name]
        seen_modules.setdefault(kind, set()).add(re.sub(r"\.(lora_[AB]|base_layer).*", "", mod_name))
        n = logical_numel(p)
        if p.requires_grad or name in trained:
            row.trainable += n
            continue
        row.frozen += n
        if on_meta and _quantised(mod_name, module, quantization) and p.dim() == 2:
            row.frozen_bytes += n * QUANT_BYTES[quantization] + (4 * p.shape[0] if quantization == "8bit" else 0)
        elif on_meta and p.is_floating_point() and unquantised_fp32(quantization):  # prepare_model_for_kbit_training
            row.frozen_bytes += p.numel() * max(p.element_size(), 4)
        else:
            row.frozen_bytes += p.numel() * p.element_size()
    for kind, row in rows.items():
        row.count = len(seen_modules[kind])
    return list(rows.values())


@dataclass
class Communication:
    """Bytes of round 1 as the strategy accounts them (``federation.comm_dtype``)."""

    sampled: list[int]
    down: dict[int, int]  # participating client -> bytes received
    up: dict[int, int]  # participating client -> bytes sent
    idle_down: dict[int, int]  # non-participating client -> bytes received (syncs)
    full_model_bytes: int  # one transfer of every parameter (full fine-tuning) in comm_dtype

    @property
    def round_up(self) -> int:
        return sum(self.up.values())

    @property
    def round_down(self) -> int:
        return sum(self.down.values()) + sum(self.idle_down.values())


def communication(recipe: Recipe, model: Any, strategy: Any, steps: int) -> Communication:
    """Round 1's bytes per client, from the strategy's own hooks (what a run's metrics.jsonl records)."""
    from fedllm.engine.server import sample_clients
    from fedllm.models.loading import read_state
    from fedllm.models.state import DTYPES, cast

    comm, fed = recipe.federation.comm_dtype, recipe.federation
    global_state = read_state(model, strategy.global_keys(model))
    sampled = sample_clients(recipe.seed, 1, fed.num_clients, recipe.sampled_per_round())
    down, up = {}, {}
    for cid in sampled:
        plan = strategy.configure_client(1, cid, global_state)
        plan.state = cast(plan.state, comm)
        down[cid], up[cid] = client_bytes(recipe, strategy, plan, global_state, steps)
    idle = strategy.extra_download_bytes(1, sampled, fed.num_clients, comm)
    return Communication(sampled, down, up, idle, base_numel(model) * DTYPES[comm].itemsize)


def base_numel(model: Any) -> int:
    """Parameters of the base model alone (what full fine-tuning trains and sends): without LoRA factors,
    PEFT's trainable head copies and tensors a strategy added (modules of fedllm's own classes)."""
    added = {id(p) for m in model.modules() if type(m).__module__.startswith("fedllm.") for p in m.parameters()}
    return sum(logical_numel(p) for n, p in model.named_parameters()
               if id(p) not in added and "lora_" not in n and ".modules_to_save." not in n)


def client_bytes(recipe: Recipe, strategy: Any, plan: Any, global_state: Any, steps: int) -> tuple[int, int]:
    """``(down, up)`` bytes of one sampled client's plan (its state cast to ``comm_dtype``), as a run counts them:
    compressed directions (``federation.compression``) as codes + block absmax, from the shapes alone."""
    from fedllm.models.compression import wire_bytes
    from fedllm.models.state import num_bytes

    comm, c = recipe.federation.comm_dtype, recipe.federation.compression
    down = strategy.download_bytes(plan, comm)
    if c.download != "none":  # the plan's global tensors travel compressed (fedllm.engine.compressed_rounds)
        exact = strategy.exact_download_keys()
        glob = {k: v for k, v in plan.state.items() if v is global_state.get(k) and k not in exact}
        down += wire_bytes(glob, c.download, c.block_size) - num_bytes(glob, comm)
    return down, upload_bytes(strategy, plan, steps, comm, c.upload, c.block_size)


def upload_bytes(strategy: Any, plan: Any, steps: int, comm: str, compression: str = "none",
                 block_size: int = 64) -> int:
    """Bytes one client sends: the strategy's upload of the state it received (same keys and shapes), as
    ``compression`` packs it (``federation.compression.upload``: codes + block absmax) or in ``comm``."""
    from fedllm.models.compression import wire_bytes
    from fedllm.models.state import cast, num_bytes

    def size(state: Any) -> int:
        return num_bytes(state, comm) if compression == "none" else wire_bytes(state, compression, block_size)

    trained = {**plan.local, **plan.state}  # what the client holds after training: same keys and shapes
    try:
        return size(cast(strategy.client_upload(plan, trained, steps), comm))
    except Exception:  # noqa: BLE001 — a strategy that needs a trained client state: count what it received
        return size(plan.state)


@dataclass
class StateBytes:
    """Tensors kept between rounds (bytes as stored)."""

    server: int  # the strategy's server state (moments, control variates, FRLoRA's base changes ...)
    global_state: int  # the aggregated trainable state
    client_entry: Optional[int]  # one client's stored per-client state (None: could not be derived)
    client_moments: int  # one client's optimizer moments when train.optimizer_state is per_client
    base_changes: int  # changes of the base every client keeps too (dense residuals, kept factors)
    client_residual: int = 0  # one client's upload-compression residuals (fp32, error feedback)
    server_residual: int = 0  # the server's download-compression residual (fp32, error feedback)


def state_bytes(recipe: Recipe, model: Any, strategy: Any, steps: int) -> StateBytes:
    """Server and per-client state bytes, from the strategy's ``state_dict`` and client hooks."""
    from fedllm.models.loading import read_state
    from fedllm.models.state import num_bytes

    global_state = read_state(model, strategy.global_keys(model))
    entry: Optional[int]
    try:
        plan = strategy.configure_client(1, 0, global_state)
        plan.client_state = {}
        strategy.open_client(plan)
        trained = {**dict(model.named_parameters()), **plan.state}  # every tensor a client could keep
        entry = num_bytes(strategy.close_client(plan, trained, steps) or {})
    except Exception:  # noqa: BLE001 — a strategy whose client state needs a trained model
        entry = None
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    slots = {"adamw": 2, "sgd": 1 if recipe.train.momentum else 0}[recipe.train.optimizer]
    moments = slots * trainable if recipe.train.optimizer_state == "per_client" else 0
    base = num_bytes(strategy.base_residuals()) + sum(
        num_bytes({"b": b, "a": a}) for pieces in strategy.kept_factors().values() for b, a, _ in pieces)
    c = recipe.federation.compression
    feedback = 4 if c.error_feedback else 0  # residuals are fp32, one value per compressed value
    upload = sum(v.numel() for v in global_state.values() if v.is_floating_point())
    return StateBytes(num_bytes(strategy.state_dict()), num_bytes(global_state), entry, moments, base,
                      feedback * upload if c.upload != "none" else 0, feedback * upload if c.download != "none" else 0)


@dataclass
class Shapes:
    """The sizes the activation formula reads from a model config."""

    layers: int
    hidden: int
    q_dim: int
    kv_dim: int
    mlp: int
    vocab: int

    @classmethod
    def of(cls, config: Any, task: str) -> "Shapes":
        text = getattr(config, "text_config", None) or config
        h = text.hidden_size
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or h // heads
        kv = getattr(text, "num_key_value_heads", None) or heads
        return cls(text.num_hidden_layers, h, heads * head_dim, kv * head_dim, text.intermediate_size,
                   text.vocab_size if task == "causal_lm" else 0)


def sequences_per_batch(recipe: Any) -> int:
    """Sequences in one training micro-batch: ``train.batch_size``, twice that for preference pairs (the chosen and
    the rejected answer of each pair go through the model together, :func:`fedllm.data.collate.pair_rows`)."""
    return recipe.train.batch_size * (2 if recipe.data.format == "preference" else 1)


def checkpointing(recipe: Any) -> int | None:
    """Every how many decoder layers ``train.gradient_checkpointing`` checkpoints one (None: off)."""
    from fedllm.engine.checkpointed import every_n_layers

    return every_n_layers(recipe.train)


def head_bytes(shapes: Shapes, tokens: int, dtype_bytes: int, head_rows: int | None, device: str = "cpu",
               compiled: bool = False) -> int:
    """The LM head's logits in the compute dtype, their fp32 copy and its gradient: ``b·s·V·(p + 8)``, or fused in
    chunks of ``c`` rows ``min(b·s, c)·V·q + b·s·h·p`` (``q``: one chunk's bytes a logit at its peak on ``device``,
    :func:`fedllm.models.fused_head_loss.chunk_peak_bytes_per_logit`; ``b·s·h·p``: the kept gradient with respect to
    the hidden states); 0 without an LM head. ``compiled``: the chunk runs compiled (``train.compile`` on a CPU)."""
    if not shapes.vocab:
        return 0
    if head_rows is None:
        return tokens * shapes.vocab * (dtype_bytes + 8)
    return head_chunk_bytes(shapes, tokens, dtype_bytes, head_rows, device, compiled) + \
        tokens * shapes.hidden * dtype_bytes


def head_chunk_bytes(shapes: Shapes, tokens: int, dtype_bytes: int, head_rows: int, device: str,
                     compiled: bool = False) -> int:
    """One chunk of the fused head at its peak: freed before backward begins."""
    from fedllm.models.fused_head_loss import chunk_peak_bytes_per_logit

    return min(tokens, head_rows) * shapes.vocab * chunk_peak_bytes_per_logit(dtype_bytes, device, compiled)


def activation_bytes(shapes: Shapes, batch: int, length: int, dtype_bytes: int, head_rows: int | None = None) -> int:
    """``b·s·L·p·(4h + 3·d_q + 2·d_kv + 4i) + b·s·V·(p + 8)``, or with the head fused in chunks of ``head_rows``
    rows ``... + min(b·s, c)·V·(p + 8) + b·s·h·p`` (see the module docstring)."""
    s = shapes
    tokens = batch * length
    per_token = 4 * s.hidden + 3 * s.q_dim + 2 * s.kv_dim + 4 * s.mlp
    trunk = tokens * s.layers * dtype_bytes * per_token
    if head_rows is None or not s.vocab:
        return trunk + tokens * s.vocab * (dtype_bytes + 8)
    return trunk + min(tokens, head_rows) * s.vocab * (dtype_bytes + 8) + tokens * s.hidden * dtype_bytes


def fused_head_rows(recipe: Recipe, model: Any, task: str, vocab: int) -> int | None:
    """Rows of one chunk of the fused head + cross-entropy where training runs it (the supervised-positions loss of a
    causal LM whose head :data:`fedllm.models.supervised_loss.FUSED_HEADS` fuses, not spread by accelerate's
    ``device_map``), else None (the full logits)."""
    from fedllm.models.fused_head_loss import chunk_rows
    from fedllm.models.supervised_loss import base_of, fused_head_weight, supports_supervised_positions

    if task != "causal_lm" or recipe.train.loss_positions != "supervised" or \
            recipe.model.device_map in ("auto", "balanced", "sequential"):
        return None
    if not supports_supervised_positions(model) or fused_head_weight(base_of(model)) is None:
        return None
    return chunk_rows(vocab)


@dataclass
class SvdCost:
    """FRLoRA's SVD init of every wrapped layer (flops; the largest layer's extra fp32 memory)."""

    method: str
    flops: float
    peak_bytes: int
    layers: int


def svd_cost(shapes: list[tuple[int, int]], rank: int, method: str, niter: int, oversample: int) -> SvdCost:
    """Flop count of the init: exact ``6mn² + 20n³`` (thin R-SVD, Golub & Van Loan, ``m >= n``);
    randomized ``2mnq(2·niter + 2) + 4(m + n)q²`` (``torch.svd_lowrank``: ``2·niter + 2`` passes over
    ``W`` with ``q = r + oversample`` probes, plus QR factorisations). Peak extra memory: the layer's
    fp32 copy plus its factors (exact: ``U``, ``S``, ``Vh`` of size ``n``; randomized: of size ``q``)."""
    flops, peak = 0.0, 0
    for out, inp in shapes:
        m, n = max(out, inp), min(out, inp)
        if method == "exact":
            flops += 6 * m * n * n + 20 * n ** 3
            peak = max(peak, 4 * (m * n + m * n + n + n * n))
        else:
            q = min(rank + oversample, n)
            flops += 2 * m * n * q * (2 * niter + 2) + 4 * (m + n) * q * q
            peak = max(peak, 4 * (m * n + (m + n) * q + q))
    return SvdCost(method, flops, peak, len(shapes))


@dataclass
class CostReport:
    """Everything ``--dry-run`` prints about a recipe's model, bytes and memory."""

    recipe: Recipe
    source: str  # where the model came from (meta device + shipped config, or real weights)
    rows: list[ParamRow]
    targets: dict[str, int]
    comm: Communication
    state: StateBytes
    shapes: Shapes
    steps: Optional[int]
    svd: Optional[SvdCost] = None
    notes: list[str] = field(default_factory=list)
    head_rows: int | None = None  # rows of a chunk of the fused head + cross-entropy (None: the full logits)
    device: str = "cpu"  # where the model trains (the estimate's default device)
    model: Any = field(default=None, repr=False)  # the model the activations are traced from (None: the formula)
    residuals: list[tuple[int, int]] = field(default_factory=list)  # (out, in) of the strategy's fp32 residuals
    dequantised: int = 0  # bitsandbytes' dequantised copy of the largest quantised weight
    tokenizer: Optional[int] = None  # the tokenizer's resident bytes (None: from the vocabulary)

    def __post_init__(self) -> None:
        self._traces: dict[tuple, Any] = {}

    @property
    def trainable(self) -> int:
        return sum(r.trainable for r in self.rows)

    @property
    def frozen(self) -> int:
        return sum(r.frozen for r in self.rows)

    def memory(self, device: Optional[str] = None, recipe: Optional[Recipe] = None) -> dict[str, int]:
        """The peak-memory estimate's terms (bytes) for a step on ``device`` (``cpu`` or ``cuda``; default: where
        this report's model trains), of ``recipe`` (default: the report's; another one changes only
        ``train.batch_size``, ``train.gradient_checkpointing`` or ``model.quantization``: the fits line's options)."""
        from fedllm.models.state import DTYPES

        r = recipe or self.recipe
        trainable = self.trainable * 4  # LoRA factors and heads train in fp32
        slots = {"adamw": 2, "sgd": 1 if r.train.momentum else 0}[r.train.optimizer]
        quant = r.model.quantization
        weights = sum(x.frozen_bytes for x in (self.rows if quant == self.recipe.model.quantization else
                                               parameter_rows(self.model, quant, True)))
        return {
            "weights": int(weights),
            "trainable": trainable,
            "gradients": trainable,
            "optimizer": slots * trainable,
            "strategy state": self.state.server,
            "base changes": self.state.base_changes,  # beside the weights: fp32 residuals, kept factors
            **self.activation_terms(device or self.device, DTYPES[r.train.dtype].itemsize, r),
            "fp32 blocks": half_block_bytes(r) if (device or self.device) == "cpu" else 0,
            "runtime": self.cpu_runtime() if (device or self.device) == "cpu" else 0,
            "compiler": CPU_COMPILER_BYTES if (device or self.device) == "cpu" and r.train.compile else 0,
        }

    def cpu_runtime(self) -> int:
        """A CPU process's bytes beside the tensors: the tokenizer (Gemma 3's 262k entries: 290 MiB) and the rest."""
        tokenizer = self.tokenizer if self.tokenizer is not None else TOKENIZER_BYTES_PER_ENTRY * self.shapes.vocab
        return CPU_RUNTIME_BYTES + int(tokenizer)

    def layer(self, device: str, recipe: Optional[Recipe] = None) -> Any:
        """One traced layer (:func:`fedllm.engine.activation_memory.layer_activations`) of ``recipe``'s step on
        ``device``, cached; None where it cannot be traced."""
        from fedllm.engine.activation_memory import layer_activations

        r = recipe or self.recipe
        key = (device, sequences_per_batch(r), r.model.quantization, r.train.compile)
        if key not in self._traces:
            try:
                self._traces[key] = None if self.model is None else layer_activations(
                    self.model, r.train, key[1], r.train.max_length, device, quantized=key[2] if key[2] != "none" else "")
            except Exception:  # noqa: BLE001 — an architecture fake tensors cannot run: the formula instead
                self._traces[key] = None
        return self._traces[key]

    def activation_terms(self, device: str, compute: int, r: Recipe) -> dict[str, int]:
        """The step's share: the trunk's saved tensors (traced, :mod:`fedllm.engine.activation_memory`), one
        layer's backward (beyond the fused head's chunk, which is freed before backward starts), the head, casts of
        FRLoRA's residuals under autocast, a dequantised weight."""
        from fedllm.engine.activation_memory import activation_peak

        rows, length = sequences_per_batch(r), r.train.max_length
        layer = self.layer(device, r)
        if layer is None:  # the formula (an architecture the trace could not run)
            return {"activations": activation_bytes(self.shapes, rows, length, compute, self.head_rows)}
        from fedllm.engine.activation_memory import checkpointed_layers
        from fedllm.engine.compiled import one_graph_for_all_widths

        every = checkpointing(r)
        trunk = activation_peak(layer, self.shapes.layers, every)
        compiled = one_graph_for_all_widths(r.train, device)  # train.compile on a CPU compiles the head's chunk too
        # the fused head's chunk is freed before backward starts: the step peaks at the larger of the two
        chunk = 0 if self.head_rows is None or not self.shapes.vocab else \
            head_chunk_bytes(self.shapes, rows * length, compute, self.head_rows, device, compiled)
        trunk["backward"] = max(0, trunk["backward"] - chunk)
        layers = self.shapes.layers - checkpointed_layers(self.shapes.layers, every) + (1 if every else 0)
        return {**trunk, "head": head_bytes(self.shapes, rows * length, compute, self.head_rows, device, compiled),
                "residual casts": residual_casts(r, self.residuals) * layers // self.shapes.layers,
                "dequantised weight": self.dequantised if r.model.quantization == self.recipe.model.quantization
                else dequantised_bytes(r, self.model)}

    def activation_lines(self) -> list[str]:
        """How the activations were estimated: the traced layer, or the formula."""
        from fedllm.engine.activation_memory import checkpointed_layers

        r, s = self.recipe, self.shapes
        rows = sequences_per_batch(r)
        pairs = " (2 x batch_size: a preference batch holds each pair's chosen and rejected answer)" \
            if rows != r.train.batch_size else ""
        layer = self.layer(self.device)
        if layer is None:
            head = "b·s·V·(p + 8)" if self.head_rows is None else \
                f"min(b·s, c)·V·(p + 8) + b·s·h·p (the head fused with its loss, chunks of c={self.head_rows} rows)"
            return [f"    activations = b·s·L·p·(4h + 3·d_q + 2·d_kv + 4i) + {head} with b={rows}{pairs}, "
                    f"s={r.train.max_length}, L={s.layers}, p={_dtype_bytes(r.train.dtype)}, h={s.hidden}, "
                    f"d_q={s.q_dim}, d_kv={s.kv_dim}, i={s.mlp}, V={s.vocab} (every sequence at max_length; "
                    "fused attention; no checkpointing; the model's layer could not be traced)"]
        every = checkpointing(r)
        kept = (f"{s.layers} layers x {_mb(layer.saved)}, no checkpointing (train.gradient_checkpointing)" if not every
                else f"checkpointed: each of the {s.layers} layers keeps only its input ({_mb(layer.boundary)}), one "
                     f"layer's {_mb(layer.saved)} is recomputed at a time" if every == 1
                else f"checkpointed: {checkpointed_layers(s.layers, every)} of the {s.layers} layers "
                     f"(layers 0, {every}, {2 * every}, ...) keep only their input ({_mb(layer.boundary)}), the others "
                     f"{_mb(layer.saved)}; one layer is recomputed at a time")
        from fedllm.engine.compiled import one_graph_for_all_widths

        compiled = " (compiled: the logits and their gradient)" if one_graph_for_all_widths(r.train, self.device) else ""
        head = "the full logits" if self.head_rows is None else f"the head fused with its loss, chunks of " \
                                                                f"{self.head_rows} rows{compiled}"
        saves = "what inductor's partition saves (train.compile) in one traced compiled layer" if layer.compiled \
            else "what autograd saves in one traced layer"
        return [f"    activations: {saves} ({self.device}, {layer.attention} attention, "
                f"{layer.stream_dtype} hidden states) at b={rows}{pairs} x s={r.train.max_length} (every sequence "
                f"at max_length): {kept}; backward: one layer's gradients"
                f"{' and the recomputed layer' if every else ''}, "
                f"beyond the head's chunk (freed before backward starts); head: {head}"]

    def lines(self) -> list[str]:
        r, c, st = self.recipe, self.comm, self.state
        comm = r.federation.comm_dtype
        out = [f"  model: {self.source}"]
        out.append(f"  parameters: {self.trainable:,} trainable (exact), {self.frozen:,} frozen "
                   f"({100 * self.trainable / max(1, self.trainable + self.frozen):.4f}% trainable)")
        width = max(len(x.name) for x in self.rows)
        out.append(f"    {'module':<{width}}  {'count':>5}  {'trainable':>13}  {'frozen':>15}")
        for x in self.rows:
            out.append(f"    {x.name:<{width}}  {x.count:>5}  {x.trainable:>13,}  {x.frozen:>15,}")
        found = ", ".join(f"{t} x{n}" for t, n in self.targets.items())
        out.append(f"  LoRA r={r.lora.r} alpha={r.lora.alpha:g} on {sum(self.targets.values())} layers: {found}")
        part = sorted(set(c.down.values())), sorted(set(c.up.values()))
        cz = r.federation.compression
        wire = comm if cz.upload == cz.download == "none" else \
            f"{comm}; compressed: up {cz.upload}, down {cz.download}, blocks of {cz.block_size}, codes + fp32 absmax"
        out.append(f"  bytes per participating client per round ({wire}; MB = 1024**2 bytes): down {_sizes(part[0])}, "
                   f"up {_sizes(part[1])}")
        idle, n_idle = sorted(set(c.idle_down.values())), r.federation.num_clients - len(c.sampled)
        out.append(f"  bytes per non-participating client per round: down {_sizes(idle) if idle else '0 B'}"
                   f" ({len(c.idle_down) if idle else n_idle} of {r.federation.num_clients} clients"
                   f"{'' if idle or not n_idle else ' receive nothing'})")
        out.append(f"  bytes per round ({len(c.sampled)} of {r.federation.num_clients} clients sampled): "
                   f"up {_mb(c.round_up)}, down {_mb(c.round_down)}; full fine-tuning would move "
                   f"{_mb(c.full_model_bytes)} per client per direction")
        entry = "unknown (needs a trained client)" if st.client_entry is None else _mb(st.client_entry)
        out.append(f"  state: server {_mb(st.server)} (strategy) + {_mb(st.global_state)} (global adapter); "
                   f"per client {entry} (strategy) + {_mb(st.client_moments)} (optimizer moments"
                   f"{', kept per client' if r.train.optimizer_state == 'per_client' else ', reset each round'})"
                   + (f"; every client also keeps the base changes, {_mb(st.base_changes)}" if st.base_changes else "")
                   + (f"; compression residuals (error feedback): {_mb(st.client_residual)} per client, "
                      f"{_mb(st.server_residual)} on the server" if st.client_residual or st.server_residual else ""))
        mem = self.memory()
        unit = (lambda n: f"{n / GB:.2f} GB") if sum(mem.values()) >= 1e8 else _mb
        out.append(f"  peak memory estimate (one training process; GB = 1024**3 bytes): {unit(sum(mem.values()))} = "
                   + " + ".join(f"{k} {unit(v)}" for k, v in mem.items() if v or k not in OPTIONAL_TERMS))
        out += self.activation_lines()
        out.append(f"    weights as loaded ({r.model.dtype}{', ' + r.model.quantization if r.model.quantization != 'none' else ''}); "
                   f"trainable, gradients and {r.train.optimizer} moments in fp32")
        if self.svd is not None:
            v = self.svd
            out.append(f"  FRLoRA SVD init ({v.method}): {_flops(v.flops)} over {v.layers} layers, "
                       f"peak extra {_mb(v.peak_bytes)} (largest layer, fp32; one layer at a time)")
        out += [f"  not checked: {n}" for n in self.notes]
        return out


def _dtype_bytes(dtype: str) -> int:
    return {"fp32": 4, "bf16": 2, "fp16": 2}[dtype]


def _mb(n: float) -> str:
    """Bytes in MB of ``1024**2`` bytes, the unit of the round lines, the plot and FlowerTune's budget."""
    return f"{n / MB:,.3f} MB" if n >= 1e5 else f"{int(n):,} B"


def _flops(n: float) -> str:
    return f"{n / 1e12:.2f} TFLOP" if n >= 1e11 else f"{n / 1e9:.3f} GFLOP"


def _sizes(values: list[int]) -> str:
    if not values:
        return "0 B"
    if len(values) == 1:
        return _mb(values[0]) + (f" ({values[0]:,} B)" if values[0] >= 1e5 else "")
    return f"{_mb(values[0])} .. {_mb(values[-1])}"


def cost_report(recipe: Recipe, model: Any, strategy: Any, task: str, source: str, on_meta: bool,
                steps: Optional[int], notes: Optional[list[str]] = None, tokenizer: Any = None) -> CostReport:
    """The report for ``model`` (PEFT-wrapped, strategy set up) under ``recipe``; ``tokenizer``: the model's, when
    loaded (its memory is measured from it, else estimated from the vocabulary)."""
    from fedllm.models.meta import target_counts
    from fedllm.strategies.frlora import FRLoRA

    rows = parameter_rows(model, recipe.model.quantization, on_meta, frozenset(strategy.global_keys(model)))
    comm = communication(recipe, model, strategy, steps or 1)
    state = state_bytes(recipe, model, strategy, steps or 1)
    shapes = Shapes.of(model.base_model.model.config, task)
    svd = None
    if isinstance(strategy, FRLoRA) and strategy.init == "principal":
        from fedllm.models.loading import lora_layers

        layer_shapes = [(m.out_features, m.in_features) for m in lora_layers(model).values()]
        svd = svd_cost(layer_shapes, recipe.lora.r, strategy.svd, strategy.niter, strategy.oversample)
    device = training_device(model)
    return CostReport(recipe, source, rows, target_counts(model, recipe.lora), comm, state, shapes, steps, svd,
                      list(notes or []), fused_head_rows(recipe, model, task, shapes.vocab), device, model,
                      fp32_residuals(strategy), dequantised_bytes(recipe, model), tokenizer_bytes(tokenizer))


def tokenizer_bytes(tokenizer: Any) -> Optional[int]:
    """A loaded tokenizer's resident bytes: :data:`TOKENIZER_BYTES_PER_SERIALISED_BYTE` times its serialised size;
    None when there is none, or it is not a fast (Rust) tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    return int(TOKENIZER_BYTES_PER_SERIALISED_BYTE * len(backend.to_str().encode()))


def training_device(model: Any) -> str:
    """``cpu`` or ``cuda``: where the model's weights are; on the meta device, where this machine would train."""
    import torch

    kind = next(model.parameters()).device.type
    if kind == "meta":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if kind == "cuda" else "cpu"


def residual_casts(recipe: Recipe, shapes: list[tuple[int, int]]) -> int:
    """Bytes autocast adds for a strategy's fp32 residual hooks (FRLoRA's ``residual: dense`` on a bf16/fp16 or
    quantised base) of ``(out, in)`` ``shapes``: each hooked layer's ``F.linear(x.float(), R)`` saves a
    compute-dtype copy of ``R`` and of ``x``."""
    from fedllm.models.state import DTYPES

    if recipe.train.dtype not in ("bf16", "fp16"):
        return 0
    tokens = sequences_per_batch(recipe) * recipe.train.max_length
    return sum((out + tokens) * inp for out, inp in shapes) * DTYPES[recipe.train.dtype].itemsize


def fp32_residuals(strategy: Any) -> list[tuple[int, int]]:
    """``(out, in)`` of the strategy's fp32 residuals a forward hook adds (:meth:`Strategy.base_residuals`)."""
    import torch

    return [tuple(t.shape) for t in strategy.base_residuals().values() if t.dim() == 2 and t.dtype == torch.float32]


def half_block_bytes(recipe: Recipe) -> int:
    """On a CPU without a bf16/fp16 GEMM a step's half-precision products run in fp32 blocks
    (:mod:`fedllm.models.cpu_half_matmul`): the blocks' bytes at most, where this recipe's step has such products."""
    import torch

    from fedllm.models import cpu_half_matmul
    from fedllm.models.state import DTYPES

    names = {recipe.train.dtype, recipe.model.dtype}
    if recipe.model.quantization == "4bit":  # QLoRA's compute dtype (fedllm.models.loading._quantization)
        names.add("bf16" if recipe.model.dtype in ("fp32", "auto") else recipe.model.dtype)
    dtypes = {DTYPES[n] for n in names if n in DTYPES}
    used = cpu_half_matmul.wanted(torch.device("cpu"), dtypes)
    return cpu_half_matmul.transient_bytes() if used else 0


def dequantised_bytes(recipe: Recipe, model: Any) -> int:
    """bitsandbytes dequantises a quantised weight for each matmul, forward and backward: the largest, in the
    compute dtype (bf16 unless ``model.dtype`` says otherwise)."""
    from fedllm.models.state import DTYPES

    q = recipe.model.quantization
    if q == "none":
        return 0
    compute = DTYPES["bf16" if recipe.model.dtype in ("fp32", "auto") else recipe.model.dtype].itemsize
    if q == "4bit-flowertune":
        compute = 4
    sizes = [logical_numel(m.weight) for n, m in model.named_modules()
             if _quantised(n, m, q) and getattr(m, "weight", None) is not None]
    return max(sizes, default=0) * compute
