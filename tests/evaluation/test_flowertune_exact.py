"""FlowerTune's exact evaluation setup: the 4-bit load of its ``eval.py`` (bitsandbytes' defaults) against
QLoRA's, what ``--quantization 4bit`` loads for its challenges, what result files record, and the hub sets that
need a loading script read from the Hub's Parquet conversion (``datasets.load_dataset`` stubbed: no network)."""

from __future__ import annotations

import json
import logging

import bitsandbytes as bnb
import bitsandbytes.functional as bnbf
import pytest
import torch
from flowertunekit import MEDICAL, RECORDS, ScriptedGenerator, write_data

import fedllm.export.inference
from fedllm.commands.cli import main
from fedllm.evaluation.flowertune_quantization import load_quantization
from fedllm.evaluation.runner import evaluate
from fedllm.evaluation.sources import DataSourceError
from fedllm.recipe.schema import EvalConfig

PARQUET = "refs/convert/parquet"


@pytest.fixture(scope="module")
def model_dir(tokenizer_state, tmp_path_factory):
    """A tiny LLaMA saved as a model directory (fp32), 64-wide so bitsandbytes' CPU kernels pack it."""
    from evalkit import tiny_llama_config
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(tokenizer_state)
    config.update({"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
                   "num_key_value_heads": 2, "head_dim": 64})
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("flowertune-4bit") / "model"
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer_state.save_pretrained(path)
    return path


def _linear4bit(model) -> dict:
    return {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def _medical_result(model, tok, tmp_path, quantization: str) -> dict:
    cfg = EvalConfig(tasks=["flowertune_medical"], data=write_data(tmp_path, "flowertune_medical", MEDICAL), limit=1,
                     quantization=quantization)
    metrics = evaluate(model, tok, cfg, tmp_path / "out", progress=False)
    assert set(metrics) == {f"flowertune_medical/{k}" for k in [*MEDICAL, "average"]}
    return json.loads((tmp_path / "out" / "flowertune_medical.json").read_text())


def test_flowertune_4bit_is_flowertune_eval_py_load_on_cpu(model_dir, tmp_path):
    """``4bit-flowertune`` holds every linear layer as FlowerTune's ``eval.py`` load does: FP4 codes of 64-wide
    blocks with plain fp32 absmax (no nested quantization), fp32 compute, the other weights fp32; the codes
    are bitsandbytes' own ``quantize_4bit`` of the saved weights, and the logits are those of FlowerTune's call."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model, tok = fedllm.export.inference.load_for_inference(str(model_dir), quantization="4bit-flowertune")
    layers = _linear4bit(model)
    assert len(layers) == 2 * 7  # q, k, v, o, gate, up, down in each of the 2 layers
    saved = load_file(model_dir / "model.safetensors")
    for name, layer in layers.items():
        state = layer.weight.quant_state
        assert (state.quant_type, state.nested, layer.compute_dtype) == ("fp4", False, torch.float32)
        codes, expected = bnbf.quantize_4bit(saved[f"{name}.weight"], blocksize=state.blocksize, quant_type="fp4",
                                             compress_statistics=False)
        assert torch.equal(layer.weight.data, codes) and torch.equal(state.absmax, expected.absmax)
    assert {p.dtype for p in model.parameters() if not isinstance(p, bnb.nn.Params4bit)} == {torch.float32}
    # FlowerTune's eval.py: from_pretrained(path, quantization_config=BitsAndBytesConfig(load_in_4bit=True),
    # torch_dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=BitsAndBytesConfig(load_in_4bit=True),
                                                  dtype=torch.float32).eval()
    ids = torch.tensor([tok("Question: Tom has 3 apples. The answer is:")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, theirs(ids).logits)

    settings = _medical_result(model, tok, tmp_path, quantization="4bit")["settings"]
    assert settings["quantization"] == "4bit-flowertune"
    assert settings["bnb_4bit"] == {"quant_type": "fp4", "double_quant": False, "compute_dtype": "float32",
                                    "other_weights": "float32", "load_dtype": "float32"}
    assert "FlowerTune's 4-bit config" in settings["quantization_note"]


def test_flowertune_medical_on_a_qlora_4bit_model_on_cpu(model_dir, tmp_path):
    """``4bit`` outside FlowerTune (``load_for_inference``'s) is QLoRA's, unchanged: NF4, nested absmax, bf16
    compute; the result file records those facts as ``4bit``. FlowerTune's codes loaded in bf16 (not its fp32
    ``torch_dtype``) are not recorded as its config either."""
    from fedllm.evaluation.flowertune_quantization import quantization_settings

    bf16, _ = fedllm.export.inference.load_for_inference(str(model_dir), dtype="bf16", quantization="4bit-flowertune")
    recorded = quantization_settings(bf16)
    assert recorded["quantization"] == "4bit" and recorded["bnb_4bit"]["load_dtype"] == "bfloat16"
    assert recorded["bnb_4bit"]["quant_type"] == "fp4"
    model, tok = fedllm.export.inference.load_for_inference(str(model_dir), quantization="4bit")
    for layer in _linear4bit(model).values():
        state = layer.weight.quant_state
        assert (state.quant_type, state.nested, layer.compute_dtype) == ("nf4", True, torch.bfloat16)
    settings = _medical_result(model, tok, tmp_path, quantization="4bit-qlora")["settings"]
    assert settings["quantization"] == "4bit" and "quantization_note" not in settings
    assert settings["bnb_4bit"] == {"quant_type": "nf4", "double_quant": True, "compute_dtype": "bfloat16",
                                    "other_weights": "float32", "load_dtype": "float32"}


def test_flowertune_4bit_request_resolution(caplog):
    board = ["flowertune_general_nlp", "flowertune_medical", "flowertune_finance"]
    with caplog.at_level(logging.INFO, logger="fedllm"):
        assert load_quantization("4bit", board) == "4bit-flowertune"
    assert "FlowerTune's 4-bit config" in caplog.text and "4bit-qlora" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fedllm"):
        assert load_quantization("4bit", ["flowertune_medical", "gsm8k"]) == "4bit"
    assert "flowertune_medical: evaluated on QLoRA's 4-bit config" in caplog.text
    assert load_quantization("4bit-qlora", ["flowertune_medical"]) == "4bit"
    assert load_quantization("4bit-flowertune", ["gsm8k"]) == "4bit-flowertune"
    assert load_quantization("4bit", ["flowertune_code"]) == "4bit"  # its board command loads unquantized
    assert load_quantization("4bit", ["gsm8k"]) == "4bit"
    assert [load_quantization(q, board) for q in ("none", "8bit")] == ["none", "8bit"]


def test_flowertune_cli_loads_the_model_as_eval_quantization_says(monkeypatch, tiny_lm, tokenizer, tmp_path, capsys):
    seen = []

    def load_for_inference(path, dtype="fp32", client=None, **kwargs):
        seen.append(kwargs)
        return ScriptedGenerator(tiny_lm, tokenizer, {}, default="A"), tokenizer

    monkeypatch.setattr(fedllm.export.inference, "load_for_inference", load_for_inference)
    data = write_data(tmp_path, "flowertune_medical", MEDICAL)
    args = ["eval", "some/model", "--tasks", "flowertune_medical", "--out", str(tmp_path / "out"), "--no-progress",
            *[f"--data={k}={v}" for k, v in data.items()]]
    for asked in ("4bit", "4bit-qlora", "4bit-flowertune", "none"):
        assert main([*args, "--quantization", asked]) == 0
    assert seen == [{"quantization": "4bit-flowertune"}, {"quantization": "4bit"},
                    {"quantization": "4bit-flowertune"}, {}]
    assert "| flowertune_medical | average |" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        main([*args, "--quantization", "3bit"])
    assert exited.value.code == 2


def test_flowertune_recipe_eval_quantization_values():
    from fedllm.recipe.checks import parse_recipe
    from fedllm.recipe.schema import RecipeError

    base = {"data": {"path": "x.jsonl"}, "train": {"local_steps": 1}}
    recipe = parse_recipe({**base, "eval": {"tasks": ["flowertune_medical"], "quantization": "4bit-flowertune"}})
    assert recipe.eval.quantization == "4bit-flowertune"
    with pytest.raises(RecipeError) as err:
        parse_recipe({**base, "eval": {"quantization": "fp4"}})
    assert "eval.quantization" in str(err.value) and "'fp4'" in str(err.value) and "4bit-flowertune" in str(err.value)


class StubHub:
    """``datasets.load_dataset`` of a hub whose script data sets fail on their main branch (as ``datasets`` >= 4
    fails them) and whose Parquet conversion holds ``export`` rows (``{(path, config): rows}``); other data sets
    serve ``main`` rows. Records every call's arguments."""

    def __init__(self, export: dict, main: dict):
        self.export, self.main, self.calls = export, main, []

    def __call__(self, path, name=None, **kwargs):
        import datasets

        self.calls.append((path, name, kwargs))
        if kwargs.get("revision") == PARQUET:
            rows = self.export.get((path, kwargs.get("data_dir")))
        else:
            rows = self.main.get((path, name))
            if (path, name) in self.export:
                raise RuntimeError(f"Dataset scripts are no longer supported, but found {path.split('/')[1]}.py")
        if rows is None:
            raise FileNotFoundError(f"{path}: no such data set in the stub")
        return datasets.Dataset.from_list(rows)


def _stored(tmp_path, name, task) -> list[tuple]:
    stored = json.loads((tmp_path / name / f"{task}.json").read_text())
    return [(e["id"], e["prompt"], e["gold"], e["output"]) for e in stored["examples"]]


def test_flowertune_medical_reads_script_sets_from_the_parquet_conversion(monkeypatch, tiny_lm, tokenizer, tmp_path):
    """bigbio's PubMedQA and MedQA (loading scripts) come from ``refs/convert/parquet`` with FlowerTune's config as
    ``data_dir`` and its split; the rows reach the same prompts, golds and accuracies as local files of them."""
    import datasets

    export = {("bigbio/pubmed_qa", "pubmed_qa_labeled_fold0_source"): RECORDS["pubmedqa"],
              ("bigbio/med_qa", "med_qa_en_4options_source"): RECORDS["medqa"]}
    main_rows = {("medmcqa", None): RECORDS["medmcqa"], ("HPAI-BSC/CareQA", "CareQA_en"): RECORDS["careqa"]}
    hub = StubHub(export, main_rows)
    monkeypatch.setattr(datasets, "load_dataset", hub)
    script = {"regular exercise": "yes", "anaphylaxis": "A", "crushing chest pain": "B", "scurvy": "A"}
    from_hub = evaluate(ScriptedGenerator(tiny_lm, tokenizer, script), tokenizer,
                        EvalConfig(tasks=["flowertune_medical"]), tmp_path / "hub", progress=False)
    assert hub.calls == [
        ("bigbio/pubmed_qa", "pubmed_qa_labeled_fold0_source", {"split": "test"}),
        ("bigbio/pubmed_qa", None, {"data_dir": "pubmed_qa_labeled_fold0_source", "split": "test",
                                    "revision": PARQUET}),
        ("medmcqa", None, {"split": "validation"}),
        ("bigbio/med_qa", "med_qa_en_4options_source", {"split": "test"}),
        ("bigbio/med_qa", None, {"data_dir": "med_qa_en_4options_source", "split": "test", "revision": PARQUET}),
        ("HPAI-BSC/CareQA", "CareQA_en", {"split": "test"})]
    cfg = EvalConfig(tasks=["flowertune_medical"], data=write_data(tmp_path, "flowertune_medical", MEDICAL))
    from_files = evaluate(ScriptedGenerator(tiny_lm, tokenizer, script), tokenizer, cfg, tmp_path / "files",
                          progress=False)
    assert from_hub == from_files and from_hub["flowertune_medical/pubmedqa"] == pytest.approx(1 / 3)
    assert _stored(tmp_path, "hub", "flowertune_medical") == _stored(tmp_path, "files", "flowertune_medical")


def test_flowertune_general_nlp_reads_mmlu_subjects_from_the_parquet_conversion(monkeypatch, tiny_lm, tokenizer,
                                                                                 tmp_path):
    """``lukaemon/mmlu``: one Parquet config per subject (``data_dir`` = the subject, split ``test``), in
    FlowerTune's subject order, each row tagged with its subject, as one local MMLU file of the same rows."""
    import datasets

    from fedllm.evaluation.flowertune_prompts import MMLU_CATEGORIES

    subjects = [s for c in ("stem", "social_sciences", "humanities") for s in MMLU_CATEGORIES[c]]
    filler = {"input": "Which is first?", "A": "1", "B": "2", "C": "3", "D": "4", "target": "A"}
    rows = {s: [{k: v for k, v in r.items() if k != "subset"} for r in RECORDS["mmlu"] if r["subset"] == s]
            or [filler] for s in subjects}
    hub = StubHub({("lukaemon/mmlu", s): rows[s] for s in subjects}, {})
    monkeypatch.setattr(datasets, "load_dataset", hub)
    cfg = EvalConfig(tasks=["flowertune_general_nlp"], limit=2)
    evaluate(ScriptedGenerator(tiny_lm, tokenizer, {}, default="A"), tokenizer, cfg, tmp_path / "hub", progress=False)
    exports = [(path, kwargs) for path, name, kwargs in hub.calls if name is None]
    assert exports == [("lukaemon/mmlu", {"data_dir": s, "split": "test", "revision": PARQUET}) for s in subjects]
    mains = [(path, name, kwargs) for path, name, kwargs in hub.calls if name is not None]
    assert mains == [("lukaemon/mmlu", s, {"split": "test"}) for s in subjects]
    local = tmp_path / "mmlu.jsonl"
    local.write_text("".join(json.dumps({**r, "subset": s}) + "\n" for s in subjects for r in rows[s]))
    cfg = EvalConfig(tasks=["flowertune_general_nlp"], limit=2, data={"flowertune_general_nlp.mmlu": str(local)})
    evaluate(ScriptedGenerator(tiny_lm, tokenizer, {}, default="A"), tokenizer, cfg, tmp_path / "files",
             progress=False)
    assert _stored(tmp_path, "hub", "flowertune_general_nlp") == _stored(tmp_path, "files", "flowertune_general_nlp")
    prompts = [p for _, p, _, _ in _stored(tmp_path, "hub", "flowertune_general_nlp")]
    assert RECORDS["mmlu"][0]["input"] in prompts[0]  # abstract_algebra, stem's first subject


def test_flowertune_script_set_without_parquet_conversion_asks_for_a_local_file(monkeypatch, tiny_lm, tokenizer):
    """Offline (or no conversion on the Hub): the same exit-2 message, naming the task, the hub id, the key, and
    the conversion tried."""
    import datasets

    def offline(path, name=None, **kwargs):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataSourceError) as raised:
        evaluate(ScriptedGenerator(tiny_lm, tokenizer, {}), tokenizer, EvalConfig(tasks=["flowertune_medical"]), None,
                 progress=False)
    message = str(raised.value)
    assert "flowertune_medical" in message and "bigbio/pubmed_qa:pubmed_qa_labeled_fold0_source@test" in message
    assert "eval.data.flowertune_medical.pubmedqa" in message and "--data flowertune_medical.pubmedqa=PATH" in message
    assert f"Parquet conversion ({PARQUET}, data_dir 'pubmed_qa_labeled_fold0_source')" in message


def test_flowertune_code_reads_multiple_from_the_parquet_conversion(monkeypatch):
    """The harness's MultiPL-E configs (``nuprl/MultiPL-E``, once a script data set) take the same path."""
    from types import SimpleNamespace

    import datasets

    from fedllm.evaluation.flowertune_code_prompts import CODE_SETS
    from fedllm.evaluation.tasks.flowertune_code import code_rows

    hub = StubHub({("nuprl/MultiPL-E", "humaneval-js"): RECORDS["multiple-js"]}, {})
    monkeypatch.setattr(datasets, "load_dataset", hub)
    ctx = SimpleNamespace(data_spec=lambda key: None, limited=lambda rows: rows)
    multiple_js = next(cs for cs in CODE_SETS if cs.key == "multiple_js")
    assert code_rows(ctx, "flowertune_code", multiple_js) == RECORDS["multiple-js"]
    assert hub.calls == [("nuprl/MultiPL-E", "humaneval-js", {"split": "test", "revision": multiple_js.revision}),
                         ("nuprl/MultiPL-E", None, {"data_dir": "humaneval-js", "split": "test", "revision": PARQUET})]
