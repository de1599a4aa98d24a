"""Typed recipe: YAML + dotted overrides -> :class:`Recipe`, with the checks that need nothing but the recipe.

Every field has a type, a default and a one-line ``doc``. :func:`build_recipe` walks the
dataclasses by their type hints and collects *every* problem (unknown key, wrong type);
:func:`value_problems` adds the impossible values. :mod:`fedllm.recipe.checks` runs both, then
the checks that ask data files, models, tasks and strategies, and raises one :class:`RecipeError`
naming the file, the dotted key, what was given and what is expected. This module imports nothing
of fedllm but its errors.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import yaml

from fedllm.common.errors import InputError, did_you_mean


def doc(default: Any, text: str) -> Any:
    """A dataclass field with a default and a one-line docstring."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"doc": text})
    if dataclasses.is_dataclass(default):
        # a deep copy: a recipe's nested sections (privacy.adaptive_clipping ...) must not share the template's
        return field(default_factory=lambda d=default: copy.deepcopy(d), metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


class RecipeError(InputError):
    """A recipe problem; ``problems`` lists ``(key, given, expected)``."""

    def __init__(self, source: str, problems: list[tuple[str, Any, str]]):
        self.source = source
        self.problems = problems
        lines = [f"{source}: {len(problems)} problem(s) in the recipe:"]
        for key, given, expected in problems:
            lines.append(f"  - {key}: got {given!r}; expected {expected}")
        super().__init__("\n".join(lines))


# --------------------------------------------------------------------------- sections


@dataclass
class ModelConfig:
    name: str = doc("tiny-llama", "preset name (tiny-llama, smollm2-135m-instruct, minilm-l6, ...), hub id, local dir or .gguf file")
    task: Literal["auto", "causal_lm", "classification"] = doc("auto", "causal LM or sequence classifier; auto picks from the preset/config")
    gguf_file: Optional[str] = doc(None, "GGUF file name inside `name` when `name` is a directory")
    dtype: Literal["fp32", "bf16", "fp16", "auto"] = doc("auto", "dtype of the base weights (auto: bf16 when train.dtype resolves to bf16, else fp32)")
    quantization: Literal["none", "4bit", "4bit-flowertune", "8bit"] = doc("none", "load the base through bitsandbytes: 4bit = QLoRA's (NF4, double quantization, bf16 compute); 4bit-flowertune = BitsAndBytesConfig(load_in_4bit=True), bitsandbytes' defaults (FP4, no double quantization, fp32 compute), as FlowerTune's templates train and its board evaluates")
    device_map: Optional[str] = doc(None, "where the base lives: null (as loaded: CPU), a device (cuda:1; cuda = this process's GPU, cuda:LOCAL_RANK), or auto (spread over every visible GPU, then CPU: a model too large for one GPU; one process)")
    num_labels: Optional[int] = doc(None, "classifier labels; default: from the data")
    revision: Optional[str] = doc(None, "hub revision")
    trust_remote_code: bool = doc(False, "allow custom model code from the hub")


#: Strategies that merge into an fp32 base in place and hold DoRA exactly there: the merge moves a product from the
#: adapter into ``W`` (FRLoRA, FedLoRU, mFedLoRU, pFedLoRU: ``W + s·(B̄Ā − B_new A_new)``; FLoRA: the stack, then
#: ``B = 0``) or adds FedEx-LoRA's residual, while the averaged magnitude ``m`` stays, so the layer computes
#: ``m ⊙ V / ‖V‖_c`` of the directions ``V`` the strategy defines (FRLoRA's init ``Ŵ0 = W0 − s·B0A0`` leaves ``W0``,
#: whose norms PEFT's ``m`` starts from). docs/compression.md, "DoRA".
DORA_MERGE_STRATEGIES = frozenset({"frlora", "frlora_v1", "frlora_v2", "frlora_v3", "fedloru", "mfedloru", "pfedloru",
                                   "fedex_lora", "flora"})


@dataclass
class LoraConfig:
    r: int = doc(8, "LoRA rank")
    alpha: float = doc(16.0, "LoRA alpha; scaling s = alpha / r")
    dropout: float = doc(0.0, "LoRA dropout")
    target_modules: Optional[list[str]] = doc(None, "module names to wrap; default: the family's attention projections")
    modules_to_save: Optional[list[str]] = doc(None, "extra fully-trained modules; default: classifier head for classifiers")
    init: Literal["default", "gaussian"] = doc("default", "PEFT init of A (B is zero)")
    use_dora: bool = doc(False, "DoRA (Liu et al. 2024): PEFT's weight-decomposed LoRA, a trained magnitude vector per wrapped layer beside B and A (docs/compression.md)")


@dataclass
class PartitionConfig:
    method: str = doc("iid", "partitioner name: iid, dirichlet, natural (registry)")
    beta: float = doc(0.5, "Dirichlet concentration (smaller = more skew)")
    column: Optional[str] = doc(None, "label/category column (dirichlet) or user column (natural)")
    min_size: int = doc(1, "smallest allowed client; Dirichlet re-draws until every client has this many")
    path: Optional[str] = doc(None, "load a partition manifest written by `fedllm partition` instead")


@dataclass
class DataConfig:
    path: str = doc("", "hub id, or local json/jsonl/csv/parquet file or directory")
    name: Optional[str] = doc(None, "hub dataset config name")
    split: str = doc("train", "split to train on")
    format: Literal["instruction", "chat", "classification", "preference"] = doc("instruction", "how records become token sequences (preference: prompt/chosen/rejected pairs, docs/preference.md)")
    template: Optional[str] = doc(None, "instruction template (default alpaca), or for chat and preference 'tokenizer' (default) or a FastChat template name; preference also takes an instruction template or 'plain' (text as given)")
    fields: dict[str, str] = doc({}, "column renames, e.g. {instruction: query, output: response, label: label}")
    labels: Optional[list[str]] = doc(None, "label names for classification (default: sorted distinct values)")
    max_examples: Optional[int] = doc(None, "keep at most this many training records (after shuffling with the seed)")
    eval_path: Optional[str] = doc(None, "held-out records (file or hub id); default: `eval_fraction` of `path`")
    eval_split: Optional[str] = doc(None, "hub split of the held-out records")
    eval_fraction: float = doc(0.0, "fraction of records held out when no eval_path is given")
    client_eval_fraction: float = doc(0.0, "fraction of each client's records held out as its personal test split")
    cache: bool = doc(True, "reuse tokenized examples from earlier runs (keyed by data file hash, tokenizer, options, max_length)")
    cache_dir: Optional[str] = doc(None, "tokenized-data cache; default $FEDLLM_CACHE_DIR or ~/.cache/fedllm (tokenized/ inside)")
    on_bad_record: Literal["error", "drop"] = doc("drop", "records with an empty text, more text than max_record_chars or nothing trainable within max_length: stop with exit 2, or drop and count them")
    max_record_chars: Optional[int] = doc(4_000_000, "a record with more characters of text is a bad record (too_large), found before tokenizing; null: no limit")

    def __post_init__(self) -> None:
        if self.template is None:
            self.template = "tokenizer" if self.format in ("chat", "preference") else "alpaca"


@dataclass
class CompressionConfig:
    upload: Literal["none", "int8", "nf4", "fp4"] = doc("none", "how clients' uploads travel: uncompressed, or quantised blockwise by bitsandbytes (int8: 8-bit dynamic code; nf4 / fp4: 4-bit codes), each client's change from the state it received")
    download: Literal["none", "int8", "nf4", "fp4"] = doc("none", "how the server's state travels to the sampled clients (as upload)")
    block_size: int = doc(64, "values per quantisation block (one fp32 absmax each): 64, 128, ..., 4096")
    error_feedback: bool = doc(True, "keep each sender's quantisation residual (the client's in its state, the server's in its checkpoint) and add it to the next round's (Seide et al. 2014; EF21)")


@dataclass
class FederationConfig:
    num_clients: int = doc(2, "clients in the partition")
    clients_per_round: Optional[int] = doc(None, "clients sampled per round (or give `fraction`)")
    fraction: Optional[float] = doc(None, "fraction of clients sampled per round")
    rounds: int = doc(1, "communication rounds")
    strategy: str = doc("fedavg", "strategy registry name")
    strategy_args: dict[str, Any] = doc({}, "keyword arguments of the strategy")
    partition: PartitionConfig = doc(PartitionConfig(), "how records are split into clients")
    comm_dtype: Literal["fp32", "bf16", "fp16"] = doc("fp32", "dtype of tensors sent, for byte accounting and transport")
    compression: CompressionConfig = doc(CompressionConfig(), "8-bit / 4-bit blockwise compression of the uploads and downloads (docs/compression.md)")
    on_client_error: Literal["skip", "fail"] = doc("skip", "a client that raises or sends a non-finite/malformed update: drop it from the round, or stop the run")
    min_clients_per_round: int = doc(1, "fewest valid updates a round aggregates; fewer: retry the round with a fresh sample")
    round_retries: int = doc(2, "fresh samples tried for a round with too few valid updates before the run stops (with a checkpoint); none under client-level DP")
    max_update_norm: Optional[float] = doc(None, "drop an update whose norm ||u - global|| is above this (null: no absolute bound)")
    communication_budget_mb: Optional[float] = doc(None, "bytes up + down for the whole run, in MB of 1024**2 bytes (FlowerTune: 200000): --dry-run projects it, summary.json reports the share; over: a warning (null: no budget)")
    round_deadline: Any = doc(None, "seconds (e.g. 600) or a multiple of the round's median client time (e.g. '2x'): a round aggregates the uploads that arrived by then (waiting for at least min_clients_per_round) and drops the later ones as late (null: wait for every client)")
    mode: Literal["sync", "async"] = doc("sync", "sync: a round waits for its sampled clients; async: buffered asynchronous aggregation (FedBuff, Nguyen et al. 2022), a round is one server step (docs/how-to/async.md)")
    async_buffer_size: Optional[int] = doc(None, "mode async: K, the uploads buffered before the server steps (null: clients sampled per round)")
    async_concurrency: Optional[int] = doc(None, "mode async: M, the clients training at once; a new one is sampled as one finishes (null: every client)")
    async_staleness: Literal["sqrt", "constant", "polynomial"] = doc("sqrt", "mode async: the staleness weight s(tau) of an update tau server steps old: 1/sqrt(1+tau) (the paper's), 1, or (1+tau)^-async_staleness_exponent")
    async_staleness_exponent: float = doc(0.5, "mode async, async_staleness polynomial: the exponent a of s(tau) = (1+tau)^-a")
    async_step_seconds: Any = doc(1.0, "mode async: virtual seconds one local step takes, a number (every client) or a list with one per client (e.g. [1, 1, 1, 5]: client 3 five times slower); sets the simulated arrival order")
    update_outlier_factor: Optional[float] = doc(1000.0, "drop an update whose norm is more than this times the median of the round's other updates (under client-level DP: this times privacy.clipping_norm; null: off)")


@dataclass
class PreferenceConfig:
    loss: Literal["sigmoid", "ipo", "hinge", "robust", "simpo"] = doc("sigmoid", "pairwise loss (train.objective: dpo): sigmoid = DPO, ipo, hinge, robust (label smoothing), simpo (reference-free); as trl's (docs/preference.md)")
    beta: float = doc(0.1, "inverse temperature of the implicit reward beta * log(pi / pi_ref) (IPO: its regularisation tau)")
    label_smoothing: float = doc(0.0, "robust: assumed share of flipped preference labels, in [0, 0.5); simpo: cDPO-style smoothing, in [0, 0.5]")
    gamma: float = doc(0.5, "simpo: target reward margin (trl's simpo_gamma)")
    reference: Literal["precomputed", "adapter_disabled"] = doc("precomputed", "reference log-probabilities: computed once per client before round 1 and kept in its state (any strategy), or the base with the adapter disabled at every step (strategies that never change the base)")


@dataclass
class TrainConfig:
    local_steps: Optional[int] = doc(None, "optimizer steps per client per round (or give local_epochs)")
    local_epochs: Optional[float] = doc(None, "passes over the client's data per round")
    batch_size: int = doc(4, "examples per micro-batch")
    grad_accum: int = doc(1, "micro-batches per optimizer step")
    lr: float = doc(2e-4, "peak learning rate")
    min_lr: float = doc(0.0, "final learning rate of the cosine/linear schedule")
    lr_schedule: Literal["constant", "cosine", "linear"] = doc("constant", "schedule across rounds (constant within a round)")
    lr_progress: Literal["first_to_last", "openfedllm", "flowertune"] = doc("first_to_last", "where round t of T sits on the cosine/linear schedule: (t-1)/(T-1) (lr at round 1, min_lr at round T); openfedllm: (t-1)/T (OpenFedLLM / FedLLM-Bench cosine_learning_rate); flowertune: t/T (FlowerTune cosine_annealing)")
    optimizer: Literal["adamw", "sgd"] = doc("adamw", "local optimizer")
    weight_decay: float = doc(0.0, "weight decay")
    momentum: float = doc(0.0, "SGD momentum")
    optimizer_state: Literal["reset", "per_client"] = doc("reset", "reset optimizer moments each round or keep them per client")
    max_grad_norm: Optional[float] = doc(None, "clip gradients to this norm")
    max_length: int = doc(512, "truncate token sequences to this length")
    dtype: Literal["fp32", "bf16", "fp16", "auto"] = doc("auto", "mixed precision of the forward/backward (torch.autocast, CPU or GPU); auto: bf16 where the device computes it natively (CPU avx512_bf16/AMX, GPU compute capability >= 8.0), else fp32")
    loss_positions: Literal["supervised", "all"] = doc("supervised", "run the LM head only where labels are supervised, or at every position")
    group_by_length: bool = doc(False, "order each client's micro-batches so similar lengths share one (seeded; less padding)")
    packing: bool = doc(False, "padding-free: each micro-batch's examples end to end in one row, per-sequence position ids, no token attending across sequences (same examples and loss as padded; causal LMs, sft)")
    clients_per_pass: int = doc(1, "train this many sampled clients of a process together in one batched pass")
    compile: Literal[False, True, "cudagraphs"] = doc(False, "torch.compile the decoder layers while a client trains (evaluation, generation and export stay eager): false; true (inductor; on a CPU one graph for every width, the head's loss compiled too, grouped-query attention, fused AdamW: a bf16 step 1.2x less CPU); cudagraphs (inductor + CUDA graphs, mode reduce-overhead; one GPU: model.device_map cuda). Compiling is paid once per process: ~35 CPU-s more on the quickstart (idle 2-core machine, cold inductor cache), ~6 from a warm cache, 22 min for the tiny recipe on a busy 2-core machine; it pays back after ~12 quickstart-sized rounds, and fedllm warns when a run is shorter (docs/performance.md, docs/gpu.md)")
    gradient_checkpointing: Union[bool, int] = doc(False, "activation checkpointing of the decoder layers while a client trains: false; true (keep each decoder layer's input hidden state, recompute one layer at a time in the backward: activations ~ layers x batch x length x hidden, ~1/3 more compute); an integer k >= 2 checkpoints every k-th layer only (layers 0, k, 2k, ...: less recompute, more memory). Gradients equal those without it (docs/performance.md)")
    pad_to_multiple_of: Optional[int] = doc(None, "right-pad each micro-batch's width up to a multiple of this (masked: the loss is unchanged), at most to train.max_length, so a compiled run sees few widths; default: 64 with train.compile on a GPU (a graph per width), else 1 (no padding)")
    threads: Optional[int] = doc(None, "CPU threads of this process; default: usable cores / local processes "
                                       "(env FEDLLM_THREADS overrides; see fedllm.common.threads)")
    objective: Literal["sft", "dpo"] = doc("sft", "what a local step minimises: sft (next-token loss on the answer) or dpo (a pairwise preference loss of train.preference on data.format: preference)")
    preference: PreferenceConfig = doc(PreferenceConfig(), "the preference loss of train.objective: dpo")


@dataclass
class JudgeConfig:
    base_url: Optional[str] = doc(None, "OpenAI-compatible endpoint; default: env FEDLLM_JUDGE_BASE_URL / OPENAI_BASE_URL")
    model: Optional[str] = doc(None, "judge model name; default: env FEDLLM_JUDGE_MODEL")
    api_key_env: str = doc("OPENAI_API_KEY", "environment variable holding the key (the key is never written)")
    concurrency: int = doc(4, "parallel judge requests")
    max_retries: int = doc(5, "retries with exponential backoff")
    protocol: Literal["openfedllm", "fastchat"] = doc("openfedllm", "Vicuna grading: OpenFedLLM's (FRLoRA's numbers) or FastChat's vicuna_bench")
    ratings: Literal["reference", "minus_one", "in_range"] = doc("reference", "means over parsed ratings as the references keep them; minus_one: unparsed count -1 (OpenFedLLM's Vicuna); in_range: ratings outside 1-10 count as unparsed")


@dataclass
class EvalConfig:
    tasks: list[str] = doc([], "task registry names evaluated on the global model; a recipe that names none: `held_out` (`pref_accuracy` for preference data) if data holds records out; [] none")
    every: int = doc(0, "evaluate every N rounds (0: only after the last round)")
    before_training: bool = doc(False, "also evaluate the initial model (round 0)")
    limit: Optional[int] = doc(None, "examples per task")
    batch_size: int = doc(8, "generation batch size")
    max_new_tokens: Optional[int] = doc(None, "generation limit; default: each task protocol's (eval/README.md)")
    decoding: Literal["protocol", "greedy"] = doc("protocol", "judged tasks: sample as the benchmark did (seeded), or greedy")
    seed: int = doc(0, "seed of sampled answers and of the sample a limited judged run takes")
    seeding: Literal["question", "batch"] = doc("question", "judged tasks' sampled answers: question = FastChat's (seeded once per question, all its turns from that stream, one at a time); batch = one seed per generation batch (batched, faster; an answer depends on its batch)")
    shots: int = doc(0, "few-shot exemplars (GSM8K)")
    answer_protocol: Literal["fedllm", "metamath", "lm_eval"] = doc("fedllm", "gsm8k/math/math500 prompt, decoding and scoring: fedllm's lenient scorer, MetaMath's scripts, or lm-evaluation-harness (eval/README.md)")
    judged_prompts: Literal["reference", "training"] = doc("reference", "judged tasks of Alpaca-style runs: prompts as the reference scripts wrote them, or the run's training prompt for every turn")
    data: dict[str, str] = doc({}, "task -> local file or hub id of its data")
    chat_template: Optional[str] = doc(None, "FastChat template name; default: a chat run's FastChat data.template, else the tokenizer's chat template")
    prompt_style: Optional[Literal["alpaca", "chat", "plain"]] = doc(None, "prompt style of the run's evaluation (fedllm eval --prompt-style overrides it); default: the one its data.format/template trained (alpaca, chat), else chat if the tokenizer has a chat template, else plain")
    personal: bool = doc(False, "personalized strategies: also evaluate each client's model on its own split")
    quantization: Literal["none", "4bit", "4bit-flowertune", "4bit-qlora", "8bit"] = doc("none", "fedllm eval: load the evaluated model through bitsandbytes; 4bit-flowertune: bitsandbytes' defaults as FlowerTune's eval.py (FP4, fp32 compute), 4bit-qlora: QLoRA's (NF4, double quantization), 4bit: FlowerTune's when every task is flowertune_general_nlp/medical/finance (the board evaluates them so), else QLoRA's")
    allow_code_execution: bool = doc(False, "run model-written programs (flowertune_code) in fedllm's sandbox; refused otherwise")
    judge: JudgeConfig = doc(JudgeConfig(), "LLM judge for MT-Bench / Vicuna / Ref-GPT4")


@dataclass
class CheckpointConfig:
    every: int = doc(0, "write a checkpoint every N rounds (0: only final)")
    keep_last: Optional[int] = doc(None, "keep only the newest N round checkpoints")


@dataclass
class LoggingConfig:
    progress: bool = doc(True, "progress bars over rounds and client steps")
    quiet: bool = doc(False, "only warnings and the run directory")
    report_to: list[str] = doc([], "experiment trackers fed each round: tensorboard, wandb, mlflow, trackio")


@dataclass
class AdaptiveClippingConfig:
    enabled: bool = doc(False, "adapt the clipping norm each round toward a quantile of the update norms (Andrew et al. 2021); privacy.clipping_norm is the initial norm")
    target_quantile: float = doc(0.5, "fraction of client updates the norm should leave unclipped, in [0, 1]")
    learning_rate: float = doc(0.2, "geometric step of the norm: C <- C * exp(-lr * (unclipped fraction - target_quantile))")
    count_stddev: Optional[float] = doc(None, "std of the noise on the unclipped count; default: clients per round / 20")


@dataclass
class SecAggConfig:
    neighbours: int = doc(8, "k: clients each client shares its secrets and pairwise masks with (rounded up to even, at most clients per round - 1: then every pair, the original SecAgg)")
    threshold: Optional[int] = doc(None, "Shamir shares that rebuild a client's secrets: more than half its neighbours, at most neighbours - max_dropouts; null: neighbours - max_dropouts")
    max_dropouts: int = doc(1, "clients that may be lost after the share exchange with the round still completing (more: the round fails and is retried as any failed round)")
    quantization_range: float = doc(1.0, "each value of a client's change (upload - the state it was sent) is clipped to [-range, range] before quantisation")
    quantization_bits: int = doc(20, "bits per quantised value: steps of 2*range/(2^bits - 1), the bound on the error of the mean")


@dataclass
class PrivacyConfig:
    mechanism: Literal["none", "central", "central_client_clipping", "dp_sgd"] = doc("none", "none; client-level DP with server-side clipping (central) or client-side clipping (central_client_clipping); sample-level DP-SGD on each client with opacus (dp_sgd)")
    clipping_norm: float = doc(1.0, "L2 bound of a client's update (central*) or of one example's gradient (dp_sgd)")
    noise_multiplier: Optional[float] = doc(None, "noise std / clipping norm; with target_epsilon too, target_epsilon is the budget the run stops at")
    target_epsilon: Optional[float] = doc(None, "epsilon after the planned rounds: picks the noise multiplier (when none is given) and stops the run before it is exceeded")
    delta: float = doc(1e-5, "delta of the (epsilon, delta) guarantee; keep it well below 1/clients (central*) or 1/examples of a client (dp_sgd)")
    accounting: Literal["auto", "without_replacement", "no_amplification"] = doc("auto", "central*: amplification by fedllm's sampling of clients without replacement (replace-one neighbours), or none (add/remove one client, as Flower; only with full participation); auto: no_amplification when every client trains every round")
    adaptive_clipping: AdaptiveClippingConfig = doc(AdaptiveClippingConfig(), "central*: adaptive clipping norm")
    grad_sample_mode: Literal["hooks", "ghost"] = doc("hooks", "dp_sgd: how opacus clips each example's gradient: hooks (per-example gradients of every trainable tensor) or ghost (per-example gradient norms by ghost clipping, then a second backward pass weighted by the clipping factors; opacus's grad_sample_mode)")
    noise_seed: Optional[int] = doc(None, "null: noise from a secret random seed (the default; needed for the guarantee); an integer reproduces the noise (experiments only: whoever knows it can remove the noise)")
    secure_aggregation: Literal["none", "secagg_plus", False] = doc("none", "secagg_plus: the server learns only the sum of the clients' quantised uploads (SecAgg+, Bell et al. 2020; simulation, one or N processes; docs/privacy.md); none (false: its old spelling)")
    secagg: SecAggConfig = doc(SecAggConfig(), "secure_aggregation: secagg_plus's parameters")
    per_client_stats: bool = doc(False, "under secure aggregation or client-level DP (central*): true records each client's loss, steps, bytes and token counts in metrics.jsonl and sends them in Flower train replies (the server then sees them un-noised); false: only totals, no training loss (docs/privacy.md)")


@dataclass
class Recipe:
    seed: int = doc(0, "seed of sampling, partition, init and data order")
    output_dir: str = doc("runs/run", "run directory")
    model: ModelConfig = doc(ModelConfig(), "base model")
    lora: LoraConfig = doc(LoraConfig(), "LoRA adapter")
    data: DataConfig = doc(DataConfig(), "training data")
    federation: FederationConfig = doc(FederationConfig(), "clients, rounds, strategy")
    train: TrainConfig = doc(TrainConfig(), "local training")
    eval: EvalConfig = doc(EvalConfig(), "evaluation during training")
    checkpoint: CheckpointConfig = doc(CheckpointConfig(), "checkpointing")
    logging: LoggingConfig = doc(LoggingConfig(), "progress and logs")
    privacy: PrivacyConfig = doc(PrivacyConfig(), "differential privacy (docs/privacy.md)")
    source: str = field(default="<recipe>", metadata={"doc": "file the recipe came from (set by the loader)", "internal": True})

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the recipe, without internal fields and with URL credentials redacted
        (the resolved recipe.yaml; see :mod:`fedllm.common.redact`)."""
        from fedllm.common.redact import redact

        d = dataclasses.asdict(self)
        d.pop("source", None)
        return redact(d)

    def sampled_per_round(self) -> int:
        """Number of clients sampled each round."""
        fed = self.federation
        if fed.clients_per_round is not None:
            return fed.clients_per_round
        if fed.fraction is not None:
            return max(1, round(fed.fraction * fed.num_clients))
        return fed.num_clients


# --------------------------------------------------------------------------- parsing

FINITE = "a finite number"
"""What a nan/inf value is told it should be (a value problem: the other checks still run)."""


MAX_YAML_NODES = 100_000
"""Most values a recipe may expand to (aliases counted at each use): refuses alias bombs ("billion laughs")."""
MAX_YAML_DEPTH = 64
"""Deepest nesting of mappings and lists a recipe may have."""
DOTTED_KEY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+|[A-Za-z_]\w*")
"""A recipe key as an override names it (``federation.rounds``)."""
MAX_SEED = 2**63 - 1
"""Largest seed (64-bit, non-negative: torch, numpy and Python generators all accept it)."""


class _UniqueKeys:
    """Refuses duplicate keys (YAML says a key is unique; PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: PyYAML's own error follows
                continue
            if first != key_node.start_mark.line + 1:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (line {key_node.start_mark.line + 1}; first given on line "
                    f"{first})", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


class _Loader(_UniqueKeys, yaml.SafeLoader):
    """SafeLoader that also reads ``1e-3`` / ``2E5`` as floats (YAML 1.2), as users write learning rates,
    and refuses duplicate keys."""


class _FastLoader(_UniqueKeys, yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader):
    """:class:`_Loader` on libyaml's C parser (PyYAML's wheels ship it), for :func:`read_written_yaml`."""


for _loader in (_Loader, _FastLoader):
    _loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""", re.X),
        list("-+0123456789."),
    )
del _loader


def read_yaml(text: str) -> Any:
    """Parse YAML text with :class:`_Loader`; a :class:`yaml.YAMLError` for duplicate keys, nesting deeper than
    :data:`MAX_YAML_DEPTH` or more than :data:`MAX_YAML_NODES` values once aliases are expanded."""
    return _parsed(text, _Loader)


def read_written_yaml(text: str) -> Any:
    """:func:`read_yaml` for YAML fedllm wrote itself (:func:`dump_recipe`: a run's recipe.yaml, a checkpoint's, the
    recipe a ServerApp sends its nodes), on libyaml's C parser, which reads the C emitter's text to the same values a
    few times faster (``tests/test_config.py``). It is more lenient than PyYAML's own parser on some malformed text (a
    tab inside a line, a ``?`` inside a flow scalar), so users' YAML goes through :func:`read_yaml`; text it refuses
    (a damaged file) gets :func:`read_yaml`'s error."""
    try:
        return _parsed(text, _FastLoader)
    except yaml.YAMLError:
        return read_yaml(text)


def _parsed(text: str, loader: type) -> Any:
    try:
        value = yaml.load(text, Loader=loader)  # noqa: S506 — a SafeLoader subclass
    except RecursionError:
        raise yaml.YAMLError(f"nested deeper than {MAX_YAML_DEPTH} levels") from None
    _expanded_size(value, 0, {})
    return value


def _expanded_size(value: Any, depth: int, memo: dict[int, int]) -> int:
    """Values in ``value`` with every alias expanded (memoised per object: linear in the YAML's own size)."""
    if not isinstance(value, (dict, list)):
        return 1
    if depth > MAX_YAML_DEPTH:
        raise yaml.YAMLError(f"nested deeper than {MAX_YAML_DEPTH} levels")
    if id(value) not in memo:
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        memo[id(value)] = 1 + sum(_expanded_size(v, depth + 1, memo) for v in items)
        if memo[id(value)] > MAX_YAML_NODES:
            raise yaml.YAMLError(f"more than {MAX_YAML_NODES:,} values once aliases are expanded (an alias bomb?)")
    return memo[id(value)]


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + (" or null" if type(None) in typing.get_args(tp) else "")
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return f"a mapping with keys {', '.join(f.name for f in _public_fields(tp))}"
    if tp is Any:
        return "any value"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _public_fields(cls: Any) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]


def _coerce(value: Any, tp: Any, key: str, problems: list) -> Any:
    """Return ``value`` as type ``tp`` or record a problem (and return the sentinel)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        _check_finite(value, key, problems)
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(value, inner[0], key, problems)
        for option in inner:  # Union[bool, int]: the first of the types that takes the value, in order
            scratch: list = []
            coerced = _coerce(value, option, key, scratch)
            if not scratch:
                return coerced
        problems.append((key, value, _type_name(tp)))
        return value
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, dict):
            return _build(tp, value, key, problems)
    elif origin is list:
        if isinstance(value, (list, tuple)):
            (item,) = typing.get_args(tp)
            return [_coerce(v, item, f"{key}[{i}]", problems) for i, v in enumerate(value)]
    elif origin is dict:
        if isinstance(value, dict):
            _, item = typing.get_args(tp)
            return {str(k): _coerce(v, item, f"{key}.{k}", problems) for k, v in value.items()}
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) <= MAX_SEED:
                return value
            problems.append((key, value, "an integer within 64 bits"))
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if math.isfinite(value):
                return float(value)
            problems.append((key, value, FINITE))
            return value
    elif tp is str:
        if isinstance(value, str):
            return value
    problems.append((key, value, _type_name(tp)))
    return value


def _check_finite(value: Any, key: str, problems: list) -> None:
    """Record every nan/inf inside a free-form value (strategy_args ...)."""
    if isinstance(value, float) and not math.isfinite(value):
        problems.append((key, value, FINITE))
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_finite(v, f"{key}.{k}", problems)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_finite(v, f"{key}[{i}]", problems)


def _build(cls: Any, raw: dict, prefix: str, problems: list) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in _public_fields(cls)}
    kwargs = {}
    for k, v in raw.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in known:
            problems.append((key, v, f"a known key of {prefix or 'the recipe'}: {', '.join(known)}"
                                     f"{did_you_mean(str(k), known)}"))
            continue
        kwargs[k] = _coerce(v, hints[k], key, problems)
    return cls(**kwargs)


def _set_dotted(raw: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = raw
    for p in parts[:-1]:
        if not isinstance(node.get(p), dict):
            node[p] = {}
        node = node[p]
    node[parts[-1]] = value


def apply_overrides(raw: dict, overrides: list[str], problems: list) -> None:
    """Apply ``key.sub=value`` strings (values parsed as YAML) to a raw recipe dict."""
    i = 0
    while i < len(overrides):
        item = overrides[i]
        i += 1
        if "=" not in item:
            if not DOTTED_KEY.fullmatch(item):
                problems.append((item, item, "an override of the form dotted.key=value"))
                continue
            value = overrides[i] if i < len(overrides) and "=" not in overrides[i] else None
            i += value is not None  # `federation.rounds 2`: one mistake, not two
            problems.append((item, item if value is None else f"{item} {value}",
                             f"an override of the form dotted.key=value (write {item}={value or 'VALUE'})"))
            continue
        key, text = item.split("=", 1)
        try:
            value = read_yaml(text) if text.strip() else ""
        except yaml.YAMLError as e:
            problems.append((key.strip(), text, f"a YAML value ({yaml_problem(e)})"))
            continue
        _set_dotted(raw, key.strip(), value)


# --------------------------------------------------------------------------- validation


def value_problems(r: Recipe) -> list[tuple[str, Any, str]]:
    """Impossible values of a typed recipe (ranges, exclusive keys): what needs no other module."""
    p: list[tuple[str, Any, str]] = []
    fed, tr = r.federation, r.train
    if r.lora.r <= 0:
        p.append(("lora.r", r.lora.r, "a positive integer"))
    for key, seed in (("seed", r.seed), ("eval.seed", r.eval.seed)):
        if not 0 <= seed <= MAX_SEED:
            p.append((key, seed, f"an integer in 0..{MAX_SEED}"))
    if r.model.device_map is not None and r.model.device_map not in ("auto", "balanced", "sequential") and not \
            r.model.device_map.split(":")[0] in ("cpu", "cuda", "mps", "xpu"):
        p.append(("model.device_map", r.model.device_map, "null, auto, balanced, sequential or a device (cuda:0)"))
    if r.lora.alpha <= 0:
        p.append(("lora.alpha", r.lora.alpha, "a positive number"))
    if not 0 <= r.lora.dropout < 1:
        p.append(("lora.dropout", r.lora.dropout, "a number in [0, 1)"))
    if fed.num_clients <= 0:
        p.append(("federation.num_clients", fed.num_clients, "a positive integer"))
    if fed.rounds <= 0:
        p.append(("federation.rounds", fed.rounds, "a positive integer"))
    if fed.clients_per_round is not None and fed.fraction is not None:
        p.append(("federation.fraction", fed.fraction, "only one of clients_per_round and fraction"))
    if fed.clients_per_round is not None and not 0 < fed.clients_per_round <= fed.num_clients:
        p.append(("federation.clients_per_round", fed.clients_per_round,
                  f"an integer in 1..num_clients ({fed.num_clients})"))
    if fed.fraction is not None and not 0 < fed.fraction <= 1:
        p.append(("federation.fraction", fed.fraction, "a number in (0, 1]"))
    if fed.partition.beta <= 0:
        p.append(("federation.partition.beta", fed.partition.beta, "a positive number"))
    if fed.partition.min_size < 1:
        p.append(("federation.partition.min_size", fed.partition.min_size, "an integer >= 1"))
    if (tr.local_steps is None) == (tr.local_epochs is None):
        p.append(("train.local_steps", tr.local_steps, "exactly one of train.local_steps and train.local_epochs"))
    if tr.local_steps is not None and tr.local_steps <= 0:
        p.append(("train.local_steps", tr.local_steps, "a positive integer"))
    if tr.local_epochs is not None and tr.local_epochs <= 0:
        p.append(("train.local_epochs", tr.local_epochs, "a positive number"))
    for key in ("batch_size", "grad_accum", "max_length", "clients_per_pass"):
        if getattr(tr, key) <= 0:
            p.append((f"train.{key}", getattr(tr, key), "a positive integer"))
    if tr.lr < 0:
        p.append(("train.lr", tr.lr, "a number >= 0"))
    if math.isfinite(tr.lr) and not 0 <= tr.min_lr <= max(tr.lr, 0):
        p.append(("train.min_lr", tr.min_lr, f"a number in [0, train.lr] (train.lr is {tr.lr})"))
    if tr.max_grad_norm is not None and tr.max_grad_norm <= 0:
        p.append(("train.max_grad_norm", tr.max_grad_norm, "a positive number or null"))
    if not r.output_dir.strip():
        p.append(("output_dir", r.output_dir, "a non-empty directory path"))
    if fed.min_clients_per_round < 1 or fed.min_clients_per_round > r.sampled_per_round():
        p.append(("federation.min_clients_per_round", fed.min_clients_per_round,
                  f"an integer in 1..clients sampled per round ({r.sampled_per_round()})"))
    for key in ("max_update_norm", "update_outlier_factor", "communication_budget_mb"):
        if getattr(fed, key) is not None and not getattr(fed, key) > 0:
            p.append((f"federation.{key}", getattr(fed, key), "a positive number, or null"))
    if fed.compression.block_size not in (64, 128, 256, 512, 1024, 2048, 4096):
        p.append(("federation.compression.block_size", fed.compression.block_size,
                  "one of 64, 128, 256, 512, 1024, 2048, 4096 (bitsandbytes' block sizes)"))
    if fed.round_retries < 0:
        p.append(("federation.round_retries", fed.round_retries, "an integer >= 0"))
    if fed.round_deadline is not None and round_deadline(fed.round_deadline) is None:
        p.append(("federation.round_deadline", fed.round_deadline,
                  "a positive number of seconds (600), a positive multiple of the median client time ('2x'), or null"))
    elif (round_deadline(fed.round_deadline) or (0, False))[1] and r.privacy.mechanism in ("central",
                                                                                          "central_client_clipping"):
        p.append(("federation.round_deadline", fed.round_deadline,
                  f"seconds (e.g. 600), not a multiple of the median client time, with privacy.mechanism "
                  f"{r.privacy.mechanism}: under client-level DP one client's time must not decide whether another "
                  "is summed"))
    if not r.data.path and not r.federation.partition.path:
        p.append(("data.path", r.data.path, "a hub id or a local data file"))
    if r.data.max_record_chars is not None and r.data.max_record_chars < 1:
        p.append(("data.max_record_chars", r.data.max_record_chars, "an integer >= 1, or null for no limit"))
    for key in ("eval_fraction", "client_eval_fraction"):
        v = getattr(r.data, key)
        if not 0 <= v < 1:
            p.append((f"data.{key}", v, "a number in [0, 1)"))
    if r.eval.every < 0:
        p.append(("eval.every", r.eval.every, "an integer >= 0"))
    if r.eval.limit is not None and r.eval.limit < 1:
        p.append(("eval.limit", r.eval.limit, "an integer >= 1, or null for every example"))
    if r.eval.max_new_tokens is not None and r.eval.max_new_tokens < 1:
        p.append(("eval.max_new_tokens", r.eval.max_new_tokens, "an integer >= 1, or null for the task's default"))
    if r.eval.batch_size < 1:
        p.append(("eval.batch_size", r.eval.batch_size, "an integer >= 1"))
    if r.eval.shots < 0:
        p.append(("eval.shots", r.eval.shots, "an integer >= 0"))
    if r.eval.judge.concurrency < 1:
        p.append(("eval.judge.concurrency", r.eval.judge.concurrency, "an integer >= 1"))
    if r.eval.judge.max_retries < 0:
        p.append(("eval.judge.max_retries", r.eval.judge.max_retries, "an integer >= 0"))
    if r.checkpoint.every < 0:
        p.append(("checkpoint.every", r.checkpoint.every, "an integer >= 0"))
    if r.checkpoint.keep_last is not None and r.checkpoint.keep_last < 1:
        p.append(("checkpoint.keep_last", r.checkpoint.keep_last, "an integer >= 1, or null to keep every checkpoint"))
    if tr.threads is not None and tr.threads <= 0:
        p.append(("train.threads", tr.threads, "a positive integer (CPU threads)"))
    return p


def round_deadline(value: Any) -> Optional[tuple[float, bool]]:
    """``federation.round_deadline`` as ``(number, relative)``: seconds (``600``, ``"600"``, ``"600s"``) or a multiple
    of the round's median client time (``"2x"``); None when ``value`` is neither (or not positive)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return (float(value), False) if math.isfinite(value) and value > 0 else None
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(x|s)?\s*", str(value), re.IGNORECASE)
    if match is None or not 0 < float(match.group(1)) < math.inf:
        return None
    return float(match.group(1)), (match.group(2) or "").lower() == "x"


def build_recipe(raw: Any, source: str, overrides: Optional[list[str]], problems: list) -> Recipe:
    """The :class:`Recipe` that ``raw`` and the dotted ``overrides`` give (``~`` expanded); every type problem
    is appended to ``problems`` (:data:`FINITE` ones for nan/inf). Raises RecipeError if ``raw`` is no mapping."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RecipeError(source, [("<top level>", type(raw).__name__, "a mapping of recipe sections")])
    apply_overrides(raw, list(overrides or []), problems)
    recipe = _build(Recipe, raw, "", problems)
    _expand_home(recipe)
    named = raw.get("eval")
    if not (isinstance(named, dict) and "tasks" in named):
        recipe.eval.tasks = default_tasks(recipe.data)
    return recipe


def default_tasks(data: DataConfig) -> list[str]:
    """The evaluation of a recipe that names no ``eval.tasks``: its held-out records, when it holds some out."""
    if not (data.eval_fraction > 0 or data.eval_path or data.eval_split):
        return []
    return ["pref_accuracy"] if data.format == "preference" else ["held_out"]


def _expand_home(recipe: Recipe) -> None:
    """``~`` and ``~user`` at the start of a path key become the home directory (never a literal ``./~``)."""
    import os

    for section, key in (("", "output_dir"), ("model", "name"), ("data", "path"), ("data", "eval_path"),
                         ("data", "cache_dir"), ("federation.partition", "path")):
        owner = recipe
        for part in filter(None, section.split(".")):
            owner = getattr(owner, part)
        value = getattr(owner, key, None)
        if isinstance(value, str) and value.startswith("~"):
            setattr(owner, key, os.path.expanduser(value))
    if isinstance(recipe.eval.data, dict):
        recipe.eval.data = {t: os.path.expanduser(v) if isinstance(v, str) and v.startswith("~") else v
                            for t, v in recipe.eval.data.items()}


UNFINISHED = ("scanning a simple key", "scanning a quoted scalar", "parsing a flow mapping", "parsing a flow sequence")
"""YAML errors the parser notices only after the line at fault (a key without its colon, an open quote or bracket):
their context mark, where the unfinished thing began, is the line to fix."""


def yaml_where(e: yaml.YAMLError) -> str:
    """``<yaml> line L, column C`` of a YAML error (1-based, as editors count): the line to fix, which for the
    :data:`UNFINISHED` errors is where the parser began the thing it could not finish, not the line after."""
    problem, context = getattr(e, "problem_mark", None), getattr(e, "context_mark", None)
    began_there = context is not None and any(what in (getattr(e, "context", None) or "") for what in UNFINISHED)
    mark = context if began_there else problem or context
    return f"<yaml> line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "<yaml>"


def yaml_problem(e: yaml.YAMLError) -> str:
    """What the YAML parser found wrong (its context and problem, without the quoted source lines)."""
    parts = [getattr(e, "context", None), getattr(e, "problem", None)]
    return "; ".join(p for p in parts if p) or str(e).splitlines()[0]


def dump_recipe(recipe: Recipe) -> str:
    """YAML text of the resolved recipe (libyaml's C emitter: the pure-Python one's text, faster; read back with
    :func:`read_written_yaml`)."""
    return yaml.dump(recipe.to_dict(), Dumper=yaml.CSafeDumper if yaml.__with_libyaml__ else yaml.SafeDumper,
                     sort_keys=False)
