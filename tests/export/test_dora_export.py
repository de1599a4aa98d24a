"""DoRA (``lora.use_dora``): FedAvg averages the magnitude vector with B and A, the merged export equals the run's
own model and PEFT's ``merge_and_unload``, the adapter export loads with peft on the original base, and strategies
DoRA cannot hold are refused at recipe load."""

import json

import pytest
import torch
from exportkit import base_recipe, save_original, write_data

from fedllm.engine.server import run
from fedllm.export import export
from fedllm.export.errors import ExportInputError
from fedllm.export.inference import model_from_checkpoint
from fedllm.recipe.checks import parse_recipe
from fedllm.recipe.schema import RecipeError
from fedllm.strategies.fedavg import FedAvg

MAGNITUDE = ".lora_magnitude_vector."


@pytest.fixture(scope="module")
def dora_run(tmp_path_factory):
    """A 2-round FedAvg DoRA run on the tiny LLaMA, with the uploads of its last round recorded."""
    root = tmp_path_factory.mktemp("dora")
    arith, _ = write_data(root)
    seen = []
    aggregate = FedAvg.aggregate

    def recording(self, rnd, global_state, updates):
        seen.append((rnd, [(u.num_examples, dict(u.state)) for u in updates]))
        return aggregate(self, rnd, global_state, updates)

    raw = base_recipe(root, "fedavg-dora", arith, lora={"use_dora": True})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FedAvg, "aggregate", recording)
        result = run(parse_recipe(raw))
    return root, result, seen


def test_dora_fedavg_averages_the_magnitude_vector(dora_run):
    _, result, seen = dora_run
    _, uploads = seen[-1]
    keys = [k for k in result.global_state if MAGNITUDE in k]
    assert keys and len(keys) == sum(".lora_A." in k for k in result.global_state)
    total = sum(n for n, _ in uploads)
    for key in keys:  # the example-weighted mean of the uploads, recomputed here in float64
        mean = sum(n * state[key].double() for n, state in uploads) / total
        assert torch.allclose(result.global_state[key].double(), mean, atol=1e-6, rtol=0), key
        assert not torch.equal(uploads[0][1][key], uploads[1][1][key])  # the clients did train it differently


def test_dora_merged_export_equals_the_run_and_peft_merge_and_unload(dora_run):
    from transformers import AutoModelForCausalLM

    root, result, _ = dora_run
    model, tok, _, _ = model_from_checkpoint(result.run_dir)
    ids = tok(["What is 3 + 4?", "What is 9 + 1?"], return_tensors="pt", padding=True)
    with torch.no_grad():
        run_logits = model.eval()(**ids).logits
        plain = model.merge_and_unload()  # PEFT's own DoRA merge of the same checkpoint (the reference)
    out = export(result.run_dir, "merged", root / "merged").out
    report = json.loads((out / "export.json").read_text()) if (out / "export.json").is_file() else {}
    merged = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        merged_logits = merged(**ids).logits
    assert (merged_logits - run_logits).abs().max() <= 1e-5
    ref = plain.state_dict()
    for name, value in merged.state_dict().items():
        assert torch.allclose(value, ref[name], atol=1e-7, rtol=0), name
    assert report == {} or "max_logit_diff" in json.dumps(report)
    original = AutoModelForCausalLM.from_pretrained(str(save_original(root, "tiny-llama"))).eval()
    with torch.no_grad():  # the run learned something visible: the comparison above is not of two base models
        assert (run_logits - original(**ids).logits).abs().max() > 1e-3


def test_dora_adapter_export_loads_with_peft_on_the_original_base(dora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, result, _ = dora_run
    model, tok, _, _ = model_from_checkpoint(result.run_dir)
    ids = tok(["What is 3 + 4?"], return_tensors="pt")
    out = export(result.run_dir, "adapter", root / "adapter").out
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["use_dora"] is True and config["base_model_name_or_path"] == "tiny-llama"
    original = AutoModelForCausalLM.from_pretrained(str(save_original(root, "tiny-llama"))).eval()
    loaded = PeftModel.from_pretrained(original, str(out)).eval()
    with torch.no_grad():
        assert (loaded(**ids).logits - model.eval()(**ids).logits).abs().max() <= 1e-5
    with pytest.raises(ExportInputError, match="DoRA"):
        export(result.run_dir, "adapter", root / "truncated", rank=2)


@pytest.mark.parametrize("strategy,args", [("fedloru", {"tau": 1}), ("frlora", {}), ("frlora_v3", {})])
def test_dora_merges_into_the_base_exactly_as_peft_merges(tmp_path, strategy, args):
    """A merge-and-reinit strategy on a DoRA model: at every merge the model computes what the averaged adapter on
    the base computed before it, and what PEFT's merge_and_unload of that model computes; the merged export of the
    run equals its model and PEFT's merge of it; the adapter export is refused with the reason."""
    import copy

    from transformers import AutoModelForCausalLM

    from fedllm.common.registry import strategies
    from fedllm.models.loading import read_state, write_state

    arith, _ = write_data(tmp_path)
    ids = torch.tensor([[1, 60, 77, 267, 315, 303, 374, 278, 36]])
    cls = strategies.get(strategy)
    original = cls.after_aggregate
    seen = []

    @torch.no_grad()
    def checking(self, rnd, model, global_state):
        kept = read_state(model, list(global_state))
        write_state(model, global_state)  # the averaged adapter on the base before the merge
        before = model.eval()(input_ids=ids).logits
        peft_merged = copy.deepcopy(model).merge_and_unload()(input_ids=ids).logits
        write_state(model, kept)
        out = original(self, rnd, model, global_state)
        write_state(model, out)
        seen.append((before, peft_merged, model(input_ids=ids).logits))
        return out

    raw = base_recipe(tmp_path, strategy, arith, lora={"use_dora": True},
                      federation={"strategy": strategy, "strategy_args": args})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cls, "after_aggregate", checking)
        result = run(parse_recipe(raw))
    assert len(seen) == 2
    for before, peft_merged, after in seen:
        assert (after - before).abs().max() <= 1e-5 and (peft_merged - before).abs().max() <= 1e-5
    model, _, _, _ = model_from_checkpoint(result.run_dir)
    with torch.no_grad():
        run_logits = model.eval()(input_ids=ids).logits
        plain = model.merge_and_unload()
    out = export(result.run_dir, "merged", tmp_path / "merged").out
    merged = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        assert (merged(input_ids=ids).logits - run_logits).abs().max() <= 1e-5
    ref = plain.state_dict()
    assert all(torch.allclose(v, ref[k], atol=1e-7, rtol=0) for k, v in merged.state_dict().items())
    with pytest.raises(ExportInputError, match="merged its updates into the base"):
        export(result.run_dir, "adapter", tmp_path / "adapter")


@pytest.mark.parametrize("strategy,args,sections,key", [
    ("fedloru", {"accumulate": "keep"}, {}, "federation.strategy_args.accumulate"),
    ("pfedloru", {"accumulate": "keep"}, {}, "federation.strategy_args.accumulate"),
    ("fedex_lora", {"residual": "dense"}, {}, "federation.strategy_args.residual"),
    ("flora", {}, {"model": {"dtype": "bf16"}}, "model.dtype"),
    ("frlora", {}, {"model": {"dtype": "bf16"}}, "model.dtype"),
    ("fedsvd", {}, {"privacy": {"mechanism": "dp_sgd", "noise_multiplier": 0.8, "clipping_norm": 0.5}},
     "lora.use_dora"),
])
def test_dora_refused_where_it_cannot_hold(tmp_path, strategy, args, sections, key):
    arith, _ = write_data(tmp_path)
    raw = base_recipe(tmp_path, "r", arith, lora={"use_dora": True},
                      federation={"strategy": strategy, "strategy_args": args}, **sections)
    with pytest.raises(RecipeError) as err:
        parse_recipe(raw)
    reason = "per-example gradient of m" if "privacy" in sections else "column norm"
    assert any(k == key and reason in expected for k, _, expected in err.value.problems), err.value.problems
