"""Helpers of the FlowerTune task tests: the records fixture, a scripted generator over a real tiny model, and
local data files of the fixture's records."""

from __future__ import annotations

import json
from pathlib import Path

import torch

ASSETS = Path(__file__).parent.parent / "assets" / "eval" / "flowertune"
RECORDS = json.loads((ASSETS / "records.json").read_text())


class ScriptedGenerator(torch.nn.Module):
    """Answers each prompt with the script's text for the last script key found in it (greedy or sampled calls
    alike, ``num_return_sequences`` copies; ``default`` when none is); records the prompts. Only ``generate`` is scripted."""

    def __init__(self, base, tokenizer, script: dict[str, str], default: str = ""):
        super().__init__()
        self.default = default
        self.base, self.config, self.generation_config = base, base.config, base.generation_config
        self.tok, self.script, self.prompts = tokenizer, script, []

    def generate(self, input_ids=None, inputs=None, attention_mask=None, max_new_tokens=None, max_length=None,
                 num_return_sequences=1, **kwargs):
        ids = input_ids if input_ids is not None else inputs
        rows = []
        for row, mask in zip(ids, attention_mask, strict=True):
            prompt = self.tok.decode(row[mask.bool()].tolist())
            self.prompts.append(prompt)
            answer = next((a for q, a in self.script.items() if q in prompt), self.default)
            new = self.tok(answer, add_special_tokens=False)["input_ids"]
            limit = max_new_tokens if max_new_tokens is not None else max_length - len(row)
            rows += [row.tolist() + new[:limit]] * num_return_sequences
        width = max(len(r) for r in rows)
        return torch.tensor([[self.tok.pad_token_id] * (width - len(r)) + r for r in rows])


def write_data(tmp_path: Path, task: str, keys: dict[str, str]) -> dict[str, str]:
    specs = {}
    for set_key, record_key in keys.items():
        path = tmp_path / f"{set_key}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS[record_key]))
        specs[f"{task}.{set_key}"] = str(path)
    return specs


MEDICAL = {"pubmedqa": "pubmedqa", "medmcqa": "medmcqa", "medqa": "medqa", "careqa": "careqa"}
