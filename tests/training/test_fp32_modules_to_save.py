"""The trained ``modules_to_save`` copies (the classifier head) are fp32 under a bf16 base
(fedllm.models.fp32_modules_to_save): parameters, gradients and AdamW moments in fp32, so an update below bf16's
resolution survives; a bf16 classification run trains, evaluates, resumes bit-exactly and exports; fp32 is untouched."""

import json

import pytest
import torch
from safetensors.torch import load_file

from fedllm.engine.client import OPTIMIZERS, micro_batch_loss, train_autocast
from fedllm.engine.server import run
from fedllm.models.fp32_modules_to_save import keep_modules_to_save_fp32
from fedllm.models.loading import load_model
from fedllm.recipe.checks import parse_recipe
from fedllm.recipe.schema import LoraConfig, ModelConfig, TrainConfig

HEAD = "classifier.modules_to_save.default."


def _batch(tokenizer):
    enc = tokenizer(["good movie", "bad film, not good at all"], padding=True, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": torch.tensor([1, 0])}


def test_bf16_head_trains_in_fp32_and_keeps_an_update_below_bf16_resolution():
    lm = load_model(ModelConfig(name="tiny-roberta", dtype="bf16"), LoraConfig(r=4, alpha=8))
    model, wrapper = lm.model, lm.model.base_model.model.classifier
    assert {p.dtype for p in wrapper.original_module.parameters()} == {torch.bfloat16}  # frozen, as loaded
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert sum(HEAD in n for n in trainable) == 4 and {p.dtype for p in trainable.values()} == {torch.float32}
    weight = wrapper.modules_to_save["default"].out_proj.weight
    lr = 1e-3  # bf16 keeps 8 bits: 1 - 1e-3 rounds to 1 (spacing 2^-8 below 1), fp32 keeps it
    with torch.no_grad():
        weight.fill_(1.0)
    opt = OPTIMIZERS["adamw"](list(trainable.values()), TrainConfig(), lr)
    with train_autocast(torch.device("cpu"), "bf16"):
        loss = micro_batch_loss(model, _batch(lm.tokenizer), TrainConfig(dtype="bf16"))
    loss.backward()
    grad = weight.grad.float()  # the expectation is computed in fp32 whatever the head's dtype
    assert weight.grad.dtype == torch.float32 and bool((grad.abs() > 1e-4).all())
    opt.step()
    # Adam's first step (Kingma & Ba, Algorithm 1, bias-corrected): m̂ = g, v̂ = g², so θ ← θ − lr·g / (|g| + ε)
    assert torch.allclose(weight.detach().float(), 1 - lr * grad / (grad.abs() + 1e-8), rtol=0, atol=1e-6)
    moments = opt.state[weight]
    assert moments["exp_avg"].dtype == moments["exp_avg_sq"].dtype == torch.float32
    model.eval()  # without autocast: the bf16 hidden state goes in, the head's output comes out in bf16
    with torch.no_grad():
        logits = model(**{k: v for k, v in _batch(lm.tokenizer).items() if k != "labels"}).logits
        with model.disable_adapter():  # the frozen bf16 original runs, uncast
            original = model(input_ids=_batch(lm.tokenizer)["input_ids"]).logits
    assert logits.dtype == original.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_an_fp32_model_is_left_as_it_is():
    model = load_model(ModelConfig(name="tiny-roberta", dtype="fp32"), LoraConfig(r=4, alpha=8)).model
    wrapper = model.base_model.model.classifier
    assert not wrapper._forward_pre_hooks and not wrapper._forward_hooks
    assert keep_modules_to_save_fp32(model) == []


def _raw(tmp_path, out, **sections):
    """A bf16 tiny-roberta classification recipe (2 rounds of 2 clients) with ``sections`` added."""
    data = tmp_path / "cls.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"text": f"good movie {i}" if i % 2 else f"bad film {i}", "label": i % 2})
                                + "\n" for i in range(32)))
    return {"seed": 0, "output_dir": str(tmp_path / out), "model": {"name": "tiny-roberta", "dtype": "bf16"},
            "lora": {"r": 4, "alpha": 8}, "data": {"path": str(data), "format": "classification"},
            "federation": {"num_clients": 2, "clients_per_round": 2, "rounds": 2, "partition": {"method": "iid"}},
            "train": {"local_steps": 2, "batch_size": 4, "lr": 1e-2, "max_length": 32, "dtype": "bf16"},
            "logging": {"progress": False, "quiet": True}, **sections}


def test_bf16_moments_of_an_older_checkpoint_load_upcast():
    """Per-client moments a run kept while its head was bf16 continue in the fp32 head's dtype (torch's
    ``Optimizer.load_state_dict`` casts so too); before, AdamW's foreach step raised on the mixed dtypes."""
    from fedllm.engine.client import _load_optimizer_state

    p = torch.nn.Parameter(torch.zeros(3))
    opt = OPTIMIZERS["adamw"]([p], TrainConfig(), 1e-3)
    moment = torch.tensor([1.0, 2.0**-9, -3.0], dtype=torch.bfloat16)
    _load_optimizer_state(opt, {id(p): "w"}, {"w::step": torch.tensor(2.0), "w::exp_avg": moment,
                                              "w::exp_avg_sq": moment.abs()})
    assert opt.state[p]["exp_avg"].dtype == torch.float32 and torch.equal(opt.state[p]["exp_avg"], moment.float())
    p.grad = torch.ones(3)
    opt.step()
    assert torch.isfinite(p).all() and int(opt.state[p]["step"]) == 3


def _recipe(tmp_path, out):
    raw = _raw(tmp_path, out, eval={"every": 1}, checkpoint={"every": 1})
    raw["data"]["eval_fraction"] = 0.25
    return parse_recipe(raw)


def _heads(run_dir):
    return {k: v for k, v in load_file(str(run_dir / "final" / "adapter.safetensors")).items() if HEAD in k}


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_dp_sgd_trains_the_fp32_head_of_a_bf16_run(tmp_path, mode):
    """opacus's per-example gradients (or ghost norms) of the fp32 head under bf16 autocast."""
    start = {k: v for k, v in load_model(ModelConfig(name="tiny-roberta", dtype="bf16"), LoraConfig(r=4, alpha=8))
             .model.named_parameters() if HEAD in k}
    dp = {"mechanism": "dp_sgd", "noise_multiplier": 1.1, "clipping_norm": 0.5, "delta": 1e-3, "noise_seed": 0,
          "grad_sample_mode": mode}
    result = run(parse_recipe(_raw(tmp_path, "dp", privacy=dp, federation={
        "num_clients": 2, "clients_per_round": 2, "rounds": 1, "partition": {"method": "iid"}})))
    heads = _heads(result.run_dir)
    assert {k.split("default.", 1)[1] for k in heads} == {"dense.weight", "dense.bias", "out_proj.weight",
                                                          "out_proj.bias"}
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in heads.values())
    assert all(not torch.equal(v, start[k].detach())
               for k, v in heads.items())
    assert result.history[-1]["epsilon"] > 0


def test_flower_apps_train_the_fp32_head_as_one_process(tmp_path, monkeypatch):
    """The in-process Flower apps (tests/test_flower_apps.py's loopback grid) give the one-process run, bit for bit."""
    pytest.importorskip("flwr")
    from flwr.supercore.task_identity import TaskIdentity

    from fedllm.flower.executor import FlowerExecutor
    from tests.test_flower_apps import LoopbackGrid, nodes

    for key in ("_run_id", "_node_id", "_task_id"):  # as test_flower_apps.py's flower_identity fixture
        monkeypatch.setattr(TaskIdentity, key, 1)

    sim = run(parse_recipe(_raw(tmp_path, "sim")))
    flower = run(parse_recipe(_raw(tmp_path, "flower")), executor=FlowerExecutor(LoopbackGrid(nodes(tmp_path, 2))))
    a, b = (load_file(str(r.run_dir / "final" / "adapter.safetensors")) for r in (sim, flower))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {v.dtype for k, v in b.items() if HEAD in k} == {torch.float32}


def test_a_bf16_classification_run_evaluates_resumes_bit_exactly_and_exports(tmp_path, crash_at_round):
    import transformers
    from peft import PeftModel

    from fedllm.export import export
    from fedllm.export.inference import model_from_checkpoint

    full = run(_recipe(tmp_path, "full"))
    assert all("held_out/accuracy" in h["eval"] for h in full.history)  # evaluated without autocast after every round
    final = load_file(str(full.run_dir / "final" / "adapter.safetensors"))
    assert len(_heads(full.run_dir)) == 4 and all(v.dtype == torch.float32 for v in final.values())
    recipe = _recipe(tmp_path, "cut")
    crash_at_round(2)
    with pytest.raises(RuntimeError, match="power cut"):
        run(recipe)
    crash_at_round(None)
    resumed = load_file(str(run(recipe, resume=True).run_dir / "final" / "adapter.safetensors"))
    assert resumed.keys() == final.keys() and all(torch.equal(final[k], resumed[k]) for k in final)

    model, tok, _, _ = model_from_checkpoint(full.run_dir)  # the run's model: bf16 base, fp32 head
    ids = tok(["good movie 3", "bad film 8"], padding=True, return_tensors="pt")
    with torch.no_grad():
        reference = model(**ids).logits.float()
    export(full.run_dir, "merged", tmp_path / "merged")  # dtype auto: the recipe's bf16
    export(full.run_dir, "adapter", tmp_path / "adapter", with_base=True)
    merged = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged").eval()
    base = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "adapter" / "base")
    adapter = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert merged.classifier.out_proj.weight.dtype == torch.bfloat16
    tolerance = 2**-6 * float(reference.abs().max())  # a few bf16 steps (8 significant bits) of the largest logit
    with torch.no_grad():
        for got in (merged(**ids).logits.float(), adapter(**ids).logits.float()):
            assert torch.allclose(got, reference, rtol=0, atol=tolerance)
