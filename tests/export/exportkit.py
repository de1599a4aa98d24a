"""Helpers of the export tests: tiny runs of every strategy, their exports, and a plain-transformers reload.

The reload runs in a fresh process that never imports fedllm: merged models are loaded with
transformers alone (the process checks that neither peft nor fedllm was imported at that point),
then adapters with peft on the original base the test saved itself.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors.torch import load_file

from fedllm.engine.server import run
from fedllm.export import export
from fedllm.export.inference import model_from_checkpoint
from fedllm.export.source import probe_inputs
from fedllm.models.loading import load_base_model, load_tokenizer
from fedllm.recipe.checks import parse_recipe
from fedllm.recipe.schema import ModelConfig

Key = Union[str, int]  # "global" or a client id

# Each case: recipe sections on top of the tiny-llama base recipe, and which exports to make.
CASES: dict[str, dict[str, Any]] = {
    "fedavg": {"truncate": True},
    "classifier": {"model": {"name": "tiny-roberta"}, "classification": True},
    "frlora": {"strategy": "frlora", "truncate": True},
    "frlora-dense": {"strategy": "frlora", "args": {"residual": "dense"}},
    "frlora_v1": {"strategy": "frlora_v1"},
    "frlora_v2": {"strategy": "frlora_v2"},
    "frlora_v3": {"strategy": "frlora_v3"},
    "fedloru": {"strategy": "fedloru", "args": {"tau": 1}, "truncate": True},
    "fedloru-keep": {"strategy": "fedloru", "args": {"tau": 1, "accumulate": "keep"}},
    "pfedloru": {"strategy": "pfedloru", "args": {"tau": 1, "personal_r": 2, "personal_alpha": 4.0},
                 "truncate": True},
    "mfedloru": {"strategy": "mfedloru", "args": {"tau": 1, "client_ranks": [2, 4, 2]}},
    "flexlora": {"strategy": "flexlora", "args": {"client_ranks": [4, 2, 4]}, "truncate": True},
    "flora": {"strategy": "flora", "args": {"client_ranks": [2, 4, 1]}},
    "fedex_lora": {"strategy": "fedex_lora"},
    "fedsa_lora": {"strategy": "fedsa_lora", "federation": {"clients_per_round": 3}},  # every client has its own B
    "scaffold": {"strategy": "scaffold"},
    "fedadam": {"strategy": "fedadam", "args": {"eta": 1e-2}},
    "ffa_lora": {"strategy": "ffa_lora"},
    "fedsvd": {"strategy": "fedsvd"},
    "fed_sb": {"strategy": "fed_sb", "truncate": True},  # W + s·B·R·A: a plain LoRA of rank 2r (B, B·R − B)
}
R, ALPHA = 4, 8.0
TRUNCATED_RANK = 2

# Runs `python -c PLAIN_LOAD spec.json`: merged models with transformers only, then adapters with peft.
PLAIN_LOAD = r"""
import json, sys
spec = json.load(open(sys.argv[1]))
import torch, transformers
from safetensors.torch import save_file
out = {}

def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)).logits.float().contiguous()

snippets = {}

def run_snippet(job):
    # a model card's usage snippet as written, in a namespace of its own; what it imported of peft / fedllm
    import traceback
    before = {m.split(".")[0] for m in sys.modules}
    scope = {"__name__": "__main__"}
    try:
        exec(job["code"], scope)
        got = {"result": scope.get("result")}
    except Exception:
        got = {"error": traceback.format_exc()[-3000:]}
    got["imported"] = sorted(({m.split(".")[0] for m in sys.modules} - before) & {"peft", "fedllm"})
    snippets[job["id"]] = got

for job in spec["plain"]:
    model = getattr(transformers, job["auto"]).from_pretrained(job["dir"]).eval()
    for name, ids in job["inputs"].items():
        out[job["id"] + "/" + name] = logits(model, ids)
leaked = sorted({m.split(".")[0] for m in sys.modules} & {"peft", "fedllm"})
fedllm_imported = "fedllm" in sys.modules
for job in spec["snippets"]["plain"]:  # merged cards: transformers alone
    run_snippet(job)
from peft import PeftModel
for job in spec["adapter"]:
    base = getattr(transformers, job["auto"]).from_pretrained(job["base"]).eval()
    model = PeftModel.from_pretrained(base, job["dir"]).eval()
    for name, ids in job["inputs"].items():
        out[job["id"] + "/" + name] = logits(model, ids)
fedllm_imported = fedllm_imported or "fedllm" in sys.modules
sys.path.insert(0, spec["root"])  # an adapter card of a tiny preset rebuilds its base with this checkout's fedllm
for job in spec["snippets"]["fedllm"]:
    run_snippet(job)
save_file(out, spec["out"])
json.dump({"leaked_before_peft": leaked, "fedllm_imported": fedllm_imported, "snippets": snippets},
          open(spec["meta"], "w"))
"""

ROOT = Path(__file__).resolve().parents[2]


def card_snippet(export_dir: Path) -> str:
    """The python block under ``## Usage`` of an export's model card."""
    return re.search(r"## Usage\n\n```python\n(.*?)```", (export_dir / "README.md").read_text(), re.S).group(1)


def card_snippet_jobs(case: Case) -> dict[str, list[dict[str, str]]]:
    """The usage snippets of ``case``'s merged and adapter cards, run by :func:`reload_plain`: the merged one with
    transformers alone, the adapter one then compared (logits) with the merged export loaded by transformers."""
    merged, adapter = case.dirs["merged/global"], case.dirs["adapter/global"]
    compare = ("\nimport torch\nfrom transformers import AutoModelForCausalLM\n"
               f"merged = AutoModelForCausalLM.from_pretrained({str(merged)!r})\n"
               "ids = tokenizer('What is 3 + 4?', return_tensors='pt')\n"
               "with torch.no_grad():\n"
               "    diff = (model(**ids).logits - merged(**ids).logits).abs().max().item()\n"
               "result = [type(model).__name__, diff]\n")
    return {"plain": [{"id": "merged", "code": card_snippet(merged) + "\nresult = type(model).__name__\n"}],
            "fedllm": [{"id": "adapter", "code": card_snippet(adapter) + compare}]}


def base_recipe(root: Path, name: str, data_file: Path, **sections: Any) -> dict[str, Any]:
    """The tests' tiny recipe (as ``tiny_recipe`` in tests/conftest.py) with ``sections`` merged in."""
    raw = {
        "seed": 0, "output_dir": str(root / name / "run"),
        "model": {"name": "tiny-llama"}, "lora": {"r": R, "alpha": ALPHA},
        "data": {"path": str(data_file), "format": "instruction",
                 "fields": {"instruction": "question", "output": "answer"}},
        "federation": {"num_clients": 3, "clients_per_round": 2, "rounds": 2, "partition": {"method": "iid"}},
        "train": {"local_steps": 2, "batch_size": 4, "lr": 1e-2, "max_length": 64, "dtype": "fp32"},  # exact values
        "logging": {"progress": False, "quiet": True},
    }
    for key, value in sections.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) and isinstance(raw.get(key), dict) else value
    return raw


def write_data(root: Path) -> tuple[Path, Path]:
    """An arithmetic instruction file and a two-class sentiment file."""
    import random

    rng = random.Random(0)
    arith = []
    for _ in range(48):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        arith.append({"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"})
    cls = [{"text": f"good movie {i}" if i % 2 else f"bad film {i}", "label": i % 2} for i in range(24)]
    paths = root / "arith.jsonl", root / "cls.jsonl"
    for path, rows in zip(paths, (arith, cls), strict=True):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


@dataclass
class Case:
    """One strategy's run, its in-memory reference logits and its exports."""

    name: str
    run_dir: Path
    auto: str  # transformers auto class of the task
    keys: list[Key]  # models exported: ["global"] or client ids
    inputs: dict[str, list[list[int]]]  # "test" and "probe" token ids
    reference: dict[str, torch.Tensor] = field(default_factory=dict)  # "<key>/<input>" -> run's logits
    dirs: dict[str, Path] = field(default_factory=dict)  # "<kind>/<key>" -> export directory
    reports: dict[str, dict[str, Any]] = field(default_factory=dict)  # "<kind>/<key>" -> export.json
    original: Optional[Path] = None  # the original base model saved by the test
    plain: dict[str, torch.Tensor] = field(default_factory=dict)  # "<kind>/<key>/<input>" -> reloaded logits
    meta: dict[str, Any] = field(default_factory=dict)  # what the reload process reports about its imports

    def ref(self, key: Key, inp: str = "test") -> torch.Tensor:
        return self.reference[f"{key}/{inp}"]

    def got(self, kind: str, key: Key, inp: str = "test") -> torch.Tensor:
        return self.plain[f"{self.name}/{kind}/{key}/{inp}"]


@torch.no_grad()
def _logits(model: Any, ids: list[list[int]]) -> torch.Tensor:
    return model(input_ids=torch.tensor(ids)).logits.float()


def save_original(root: Path, model_name: str) -> Path:
    """The original base model as fedllm builds it for a run (seed 0), saved with save_pretrained."""
    where = root / f"original-{model_name}"
    if not where.exists():
        tok = load_tokenizer(ModelConfig(name=model_name))
        load_base_model(ModelConfig(name=model_name), tok, num_labels=2, seed=0).save_pretrained(str(where))
        tok.save_pretrained(str(where))
    return where


def build_case(root: Path, name: str, data: tuple[Path, Path]) -> Case:
    """Run the case's recipe, record the run's logits, export merged + exact adapter (+ truncated)."""
    spec = CASES[name]
    sections: dict[str, Any] = {"federation": {"strategy": spec.get("strategy", "fedavg"),
                                               "strategy_args": spec.get("args", {}), **spec.get("federation", {})}}
    if "model" in spec:
        sections["model"] = spec["model"]
    if spec.get("classification"):
        sections["data"] = {"path": str(data[1]), "format": "classification", "fields": {}}
        sections["train"] = {"max_length": 32}
    recipe = parse_recipe(base_recipe(root, name, data[0], **sections))
    result = run(recipe)
    personalized = result.strategy.personalized
    tok = result.tokenizer
    gen = torch.Generator().manual_seed(1)
    case = Case(name, result.run_dir,
                "AutoModelForSequenceClassification" if spec.get("classification") else "AutoModelForCausalLM",
                list(range(recipe.federation.num_clients)) if personalized else ["global"],
                {"test": torch.randint(10, len(tok), (2, 12), generator=gen).tolist(),
                 "probe": probe_inputs(tok)["input_ids"].tolist()})
    case.original = save_original(root, recipe.model.name)
    for key in case.keys:
        model = result.model.eval() if key == "global" else model_from_checkpoint(result.run_dir, client=key)[0]
        for inp, ids in case.inputs.items():
            case.reference[f"{key}/{inp}"] = _logits(model, ids)
    out = root / name
    exports = [("merged", {}), ("adapter", {})]
    if spec.get("truncate"):
        exports.append(("truncated", {"rank": TRUNCATED_RANK, "client": 0 if personalized else None}))
    for kind, options in exports:
        result_ = export(result.run_dir, "merged" if kind == "merged" else "adapter", out / kind, **options)
        for item in result_.exports:
            key = "global" if item["client"] is None else item["client"]
            case.dirs[f"{kind}/{key}"] = Path(item["path"])
            case.reports[f"{kind}/{key}"] = json.loads((Path(item["path"]) / "export.json").read_text())
    return case


def reload_plain(root: Path, cases: list[Case], snippets: Optional[dict[str, list]] = None) -> dict[str, Any]:
    """Reload every export (and each original base) in one fresh process; fill ``case.plain``; run ``snippets``
    (:func:`card_snippet_jobs`) there too, their outcome under ``["snippets"]`` of what it returns."""
    spec: dict[str, Any] = {"plain": [], "adapter": [], "out": str(root / "plain.safetensors"),
                            "meta": str(root / "plain.json"), "root": str(ROOT),
                            "snippets": snippets or {"plain": [], "fedllm": []}}
    for case in cases:
        spec["plain"].append({"id": f"{case.name}/original/global", "dir": str(case.original), "auto": case.auto,
                              "inputs": case.inputs})
        for label, where in case.dirs.items():
            kind = label.split("/")[0]
            job = {"id": f"{case.name}/{label}", "dir": str(where), "auto": case.auto, "inputs": case.inputs}
            if kind == "merged":
                spec["plain"].append(job)
            else:
                spec["adapter"].append({**job, "base": str(case.original)})
    (root / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", PLAIN_LOAD, str(root / "spec.json")], cwd=str(root), env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    logits = load_file(spec["out"])
    for case in cases:
        case.plain = {k: v for k, v in logits.items() if k.startswith(case.name + "/")}
    return json.loads(Path(spec["meta"]).read_text())
