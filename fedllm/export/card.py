"""The model card (README.md) written into every export: provenance, results, the exact command."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

from fedllm.export.source import PROBE_TEXT, Source
from fedllm.recipe.schema import ModelConfig


def _hub_id(name: str) -> Optional[str]:
    """``name`` when it looks like a hub id (``org/model``), for the card's ``base_model`` metadata."""
    parts = name.split("/")
    if len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~")) and not name.endswith(".gguf"):
        return name
    return None


def _front_matter(fmt: str, source: Source) -> str:
    lines = ["---", f"library_name: {'peft' if fmt == 'adapter' else 'transformers'}"]
    hub = _hub_id(source.recipe.model.name)
    if hub:
        lines.append(f"base_model: {hub}")
    lines += ["tags:", "- fedllm", "- federated-learning", "- lora", f"- {source.recipe.federation.strategy}", "---"]
    return "\n".join(lines)


def _auto_class(source: Source) -> str:
    task = source.meta.get("task")
    return "AutoModelForSequenceClassification" if task == "classification" else "AutoModelForCausalLM"


def _base_loading(source: Source, info: dict[str, Any], where: str) -> tuple[str, str, str]:
    """(imports, code that sets ``base``, note) loading the run's original base model as written."""
    auto, cfg = _auto_class(source), source.recipe.model
    labels = f", num_labels={len(source.label_names)}" if source.meta.get("task") == "classification" else ""
    if info.get("with_base"):
        return (f"from transformers import {auto}", f"base = {auto}.from_pretrained({where + '/base'!r}{labels})",
                "The original base model is saved in `base/` (written with `--with-base`).")
    from fedllm.models.loading import model_presets

    if cfg.name in model_presets:
        preset = model_presets.get(cfg.name)
        if preset.location is not None:  # weights shipped in a package: its real local path
            directory, gguf = preset.location()
            gguf_arg = f", gguf_file={gguf!r}" if gguf else ""
            return (f"from transformers import {auto}",
                    f"base = {auto}.from_pretrained({directory!r}{gguf_arg}{labels})",
                    f"`{cfg.name}` is a fedllm preset: its weights are the files shipped in a Python package, "
                    "loaded above from where that package is installed on the machine that exported.")
        defaults = ModelConfig()
        fields = ", ".join(f"{f.name}={getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg)
                           if getattr(cfg, f.name) != getattr(defaults, f.name) or f.name == "name")
        n = len(source.label_names) or 2
        return ("from fedllm.recipe.schema import ModelConfig\nfrom fedllm.models.loading import load_base_model, load_tokenizer",
                f"cfg = ModelConfig({fields})\nbase = load_base_model(cfg, load_tokenizer(cfg), num_labels={n}, "
                f"seed={source.recipe.seed})",
                f"`{cfg.name}` is a fedllm preset built from a config with the run's seed, so fedllm rebuilds it "
                "(or export again with `--with-base` to get a copy of the base next to the adapter).")
    name, gguf = cfg.name, cfg.gguf_file
    if name.endswith(".gguf"):
        name, gguf = str(Path(name).expanduser().resolve().parent), Path(name).name
    elif Path(name).expanduser().exists():
        name = str(Path(name).expanduser().resolve())
    gguf_arg = f", gguf_file={gguf!r}" if gguf else ""
    revision = f", revision={cfg.revision!r}" if cfg.revision else ""
    return (f"from transformers import {auto}", f"base = {auto}.from_pretrained({name!r}{gguf_arg}{revision}{labels})",
            f"`base_model_name_or_path` is the run's model `{cfg.name}`.")


# Third-party notices a user of the adapter snippet would otherwise see: peft imports bitsandbytes, whose CPU build
# logs a warning about an optional kernel package (and that package, ``kernels`` 0.19, one about skipping its
# publisher check offline), and peft reads a property transformers 5 deprecates.
QUIET_THIRD_PARTY = ("import logging\nimport warnings\n\n"
                      "logging.getLogger(\"bitsandbytes\").setLevel(logging.ERROR)  "
                      "# peft imports it; its CPU build warns about an optional kernel\n"
                      "logging.getLogger(\"kernels\").setLevel(logging.ERROR)  "
                      "# which bitsandbytes asks for; offline it warns that it skips a check\n"
                      "warnings.filterwarnings(\"ignore\", message=\".*is_gradient_checkpointing\")  "
                      "# peft reads a property transformers deprecates\n")


def _usage(fmt: str, source: Source, info: dict[str, Any], where: Optional[Path] = None) -> str:
    """A snippet that runs as written: ``where`` is the export directory (absolute)."""
    auto = _auto_class(source)
    here = str(where) if where is not None else "path/to/this/dir"
    if fmt == "merged":
        return (f"```python\nfrom transformers import AutoTokenizer, {auto}\n\n"
                f"model = {auto}.from_pretrained({here!r})\n"
                f"tokenizer = AutoTokenizer.from_pretrained({here!r})\n```")
    imports, base, note = _base_loading(source, info, here)
    return (f"```python\n{QUIET_THIRD_PARTY}"
            f"from peft import PeftModel\nfrom transformers import AutoTokenizer\n{imports}\n\n"
            f"{base}\nmodel = PeftModel.from_pretrained(base, {here!r})\n"
            f"tokenizer = AutoTokenizer.from_pretrained({here!r})\n```\n\n" + note)


def _prompt_format(source: Source, info: dict[str, Any]) -> str:
    """Which prompt the model was trained to answer (what ``fedllm serve`` uses by default)."""
    data = source.recipe.data
    if info.get("prompt_style") == "alpaca":
        from fedllm.data.templates import INSTRUCTION_TEMPLATES

        name = data.template if data.template in INSTRUCTION_TEMPLATES else "alpaca"  # openfedllm: its spelling
        template = INSTRUCTION_TEMPLATES[name].no_input.format(instruction="{instruction}")
        return ("Trained on instruction records with the Alpaca template: prompt it with the text below "
                "(the `### Input:` variant when there is an input) and read the answer after `### Response:`. "
                "`fedllm serve` renders chat requests this way by default (`--prompt-style chat` uses the "
                f"tokenizer's chat template instead).\n\n```text\n{template}\n```")
    if data.format == "chat":
        how = ("the tokenizer's chat template (`tokenizer.apply_chat_template`)" if data.template == "tokenizer"
               else f"the FastChat conversation template `{data.template}`")
        return f"Trained on conversations rendered with {how}; `fedllm serve` uses the same by default."
    if data.format == "classification":
        return "A sequence classifier: give it the text (and `text_pair`, if trained with one) as is."
    return (f"Trained on instruction records with the template `{data.template}`; prompt it in that format "
            "(`fedllm serve` defaults to the tokenizer's chat template for it: pass `--prompt-style`).")


def _training_table(source: Source) -> str:
    r = source.recipe
    fed, tr = r.federation, r.train
    per_round = fed.clients_per_round if fed.clients_per_round is not None else (
        f"fraction {fed.fraction}" if fed.fraction is not None else fed.num_clients)
    local = f"{tr.local_steps} steps" if tr.local_steps is not None else f"{tr.local_epochs} epochs"
    rows = [
        ("strategy", f"`{fed.strategy}` {json.dumps(fed.strategy_args) if fed.strategy_args else ''}".rstrip()),
        ("model", f"`{r.model.name}` ({r.model.dtype}, quantization {r.model.quantization})"),
        ("LoRA", f"r={r.lora.r}, alpha={r.lora.alpha}, targets {r.lora.target_modules or 'family default'}"),
        ("rounds", f"{source.round} of {fed.rounds}"),
        ("clients", f"{fed.num_clients}, {per_round} per round"),
        ("data", f"`{r.data.path}` ({r.data.format}), partition {fed.partition.method}"),
        ("local training", f"{local}, batch {tr.batch_size} x {tr.grad_accum}, {tr.optimizer}, lr {tr.lr}"),
        ("lr schedule", tr.lr_schedule),
        ("seed", str(r.seed)),
    ]
    return "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


def _metric_lines(metrics: dict[str, Any]) -> list[str]:
    return [f"  - {k}: {v:.6g}" if isinstance(v, (int, float)) else f"  - {k}: {v}" for k, v in metrics.items()]


RELEASED_UNDER_DP = ("rounds", "strategy", "initial_eval", "final_eval", "epsilon", "privacy")
"""The only summary.json entries a card releases under differential privacy: the guarantee (ε, and ``privacy``: the
settings, the noise, the current clipping norm — itself set by noised releases — without ``unclipped``, the exact
count) and evaluations of the released model. Everything else in summary.json is computed from the clients' data
with no noise: the training loss, the dropped clients, bytes (they count the accepted uploads), seconds, per-client
ε (each client's steps), the personal evaluations on each client's own data."""


def _released(summary: dict[str, Any], private: bool) -> dict[str, Any]:
    """``summary`` as a card may release it: under DP only :data:`RELEASED_UNDER_DP`, without the exact count."""
    if not private:
        return summary
    out = {k: v for k, v in summary.items() if k in RELEASED_UNDER_DP}
    if isinstance(out.get("privacy"), dict):
        out["privacy"] = {k: v for k, v in out["privacy"].items() if k != "unclipped"}
    return out


def _privacy_notes(source: Source, client: Optional[int]) -> list[str]:
    """What a DP run's card must say about what the guarantee does not cover in this export."""
    pv, lines = source.recipe.privacy, []
    if pv.mechanism == "none":
        return lines
    if pv.noise_seed is not None:
        lines.append(f"- **privacy.noise_seed is set ({pv.noise_seed})**: the noise (and, under client-level DP, the "
                     "client sample) can be recomputed from this card, so the differential-privacy guarantee does not "
                     "hold (a setting for experiments only)")
    if client is not None:
        lines.append(f"- client {client}'s personal model: its private tensors were trained on its data and never "
                     "noised; the differential-privacy guarantee covers the global part only")
    return lines


def _results(source: Source, client: Optional[int]) -> str:
    m = source.metrics
    notes = _privacy_notes(source, client)
    if not m:
        return "\n".join([*notes, "No metrics were found beside the checkpoint."])
    lines = list(notes)
    private = source.recipe.privacy.mechanism != "none"
    if private and m.get("train_loss") is not None:
        lines.append("- train loss: not released (under differential privacy the clients' losses are not noised)")
    elif m.get("train_loss") is not None:
        lines.append(f"- train loss (round {m['round']}): {m['train_loss']:.6g}")
    if private and "bytes_up_total" in m:
        lines.append("- communication: not released (under differential privacy the bytes count the accepted uploads)")
    elif "bytes_up_total" in m:
        lines.append(f"- communication: {m['bytes_up_total']} bytes up, {m['bytes_down_total']} bytes down")
    if m.get("eval"):
        lines.append(f"- evaluation of the global model after round {m['eval_round']}:")
        lines += _metric_lines(m["eval"])
    personal = (m.get("personal_eval") or {}).get(str(client)) if client is not None else None
    if private and isinstance(personal, dict) and personal:
        lines.append(f"- evaluation of client {client}'s model on its own data: not released (no noise protects it)")
    elif isinstance(personal, dict) and personal:
        lines.append(f"- evaluation of client {client}'s model on its own data after round {m['personal_eval_round']}:")
        lines += _metric_lines(personal)
    summary = m.get("summary")
    if summary:
        note = f" (under DP only {', '.join(RELEASED_UNDER_DP)}; no unclipped count)" if private else ""
        lines.append(f"- summary.json{note}: `{json.dumps(_released(summary, private), sort_keys=True)}`")
    return "\n".join(lines) or "No metrics were found beside the checkpoint."


def _export_facts(fmt: str, info: dict[str, Any]) -> str:
    lines = [f"- format: {fmt}, dtype {info['dtype']}"]
    if info.get("client") is not None:
        lines.append(f"- client {info['client']}'s personal model")
    if fmt == "adapter":
        rank = (f"{info['rank_min']}..{info['rank_max']}" if info["rank_min"] != info["rank_max"]
                else str(info["rank_max"]))
        lines.append(f"- LoRA rank {rank} (config r={info['r']}, lora_alpha={info['alpha']}), "
                     f"{info['layers']} layers, built by {', '.join(f'{k} ({v})' for k, v in info['methods'].items())}")
        if info["exact"]:
            lines.append(f"- exact: every layer's learned change is represented in full "
                         f"(largest relative error {info['rel_error_max']:.3g}, fp32 rounding)")
        else:
            lines.append(f"- truncated to rank {info['rank_max']} by SVD in {len(info['truncated_layers'])} of "
                         f"{info['layers']} layers (the change needs rank up to {info['exact_rank_max']}); "
                         f"relative error ||dW - s*B@A||_F / ||dW||_F: max {info['rel_error_max']:.6g} over layers")
    else:
        lines.append(f"- {info['layers']} LoRA-wrapped layers merged in float64/fp32"
                     + (f" (base dequantized from {info['dequantized_from']})" if info.get("dequantized_from") else "")
                     + (f", stored in the base's {info['merged_in']} (their fp32 weights did not fit on disk beside "
                        "the export)" if info.get("merged_in") else ""))
    check = "checked" if info.get("checked") else "reported"
    lines.append(f"- largest logit difference to the run's model on the probe text {PROBE_TEXT!r}: "
                 f"{info['max_logit_diff']:.3g} ({check})")
    return "\n".join(lines)


def model_card(fmt: str, source: Source, info: dict[str, Any], command: str, where: Optional[Path] = None) -> str:
    """README.md text of one export.

    Args:
        fmt: ``merged`` or ``adapter``.
        source: The export source (recipe, checkpoint, metrics).
        info: Facts returned by the writer, plus ``dtype``, ``client``, ``with_base``.
        command: The exact ``fedllm export ...`` command line.
        where: The export's final directory (the usage snippet loads from it).
    """
    who = f" — client {info['client']}" if info.get("client") is not None else ""
    title = "merged model" if fmt == "merged" else "LoRA adapter"
    return "\n\n".join([
        _front_matter(fmt, source),
        f"# fedllm {title}: {source.recipe.federation.strategy} on {source.recipe.model.name}{who}",
        f"Exported from the fedllm checkpoint `{source.checkpoint}` (round {source.round}).",
        "## Usage", _usage(fmt, source, info, where),
        "## Prompt format", _prompt_format(source, info),
        "## Training", _training_table(source),
        "## Results", _results(source, info.get("client")),
        "## Export", _export_facts(fmt, info),
        "## Command", f"```bash\n{command}\n```",
        "## Recipe", f"```yaml\n{source.recipe_yaml.rstrip()}\n```",
    ]) + "\n"
