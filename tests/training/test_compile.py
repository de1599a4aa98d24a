"""train.compile (fedllm.engine.compiled): the decoder layers compiled while a client trains; one graph for every
micro-batch width on a CPU, a graph per padded width on a GPU.

Inductor takes minutes on this CPU, so the wiring runs under dynamo's ``eager`` backend (tracing, guards and graphs,
no code generation): a compiled run equals the eager run bit for bit in fp32 and keeps every key; the layers are
compiled only inside the client's training and reused by the next client; padding a micro-batch to a multiple leaves
its loss and gradients unchanged (fp32, <= 1e-6); what cannot hold is refused at recipe load (exit 2).
"""

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from fedllm.data.collate import collate
from fedllm.data.tokens import IGNORE_INDEX
from fedllm.engine import compiled
from fedllm.models.loading import load_model
from fedllm.models.supervised_loss import all_positions_loss, supervised_positions_loss
from fedllm.recipe.schema import LoraConfig, ModelConfig, TrainConfig


@pytest.fixture
def eager_backend(monkeypatch):
    """dynamo's eager backend instead of inductor, and dynamo's graph counter from zero."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(compiled, "BACKEND", "eager")
    counters.clear()
    return counters


@pytest.fixture(scope="module")
def tiny():
    """A tiny LLaMA with non-zero LoRA factors (B = 0 would leave A's gradient zero)."""
    model = load_model(ModelConfig(name="tiny-llama"), LoraConfig(r=4, alpha=8, init="gaussian")).model
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def test_widths_round_up_to_the_multiple_and_stop_at_max_length():
    assert [compiled.padded_width(w, 64, 512) for w in (5, 64, 65, 500, 512)] == [64, 64, 128, 512, 512]
    assert [compiled.padded_width(w, 64, 96) for w in (5, 70, 96, 100)] == [64, 96, 96, 100]  # never past max_length
    for device in ("cpu", "cuda"):
        assert compiled.pad_multiple(TrainConfig(), device) == 1
        assert compiled.pad_multiple(TrainConfig(compile=True, pad_to_multiple_of=8), device) == 8
    assert compiled.pad_multiple(TrainConfig(compile=True), "cuda") == 64  # a graph per width: few widths
    assert compiled.pad_multiple(TrainConfig(compile="cudagraphs"), "cuda") == 64
    assert compiled.pad_multiple(TrainConfig(compile=True), "cpu") == 1  # one graph for every width: no padding
    assert compiled.widths(TrainConfig(compile=True, max_length=512), "cuda") == 9  # 64, ..., 512 and 512 itself
    assert compiled.widths(TrainConfig(compile=True, max_length=512), "cpu") == 1
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    from fedllm.engine.client import resolved

    assert resolved(TrainConfig(compile=True, dtype="fp32"), cpu).pad_to_multiple_of == 1
    assert resolved(TrainConfig(compile=True, dtype="fp32"), gpu).pad_to_multiple_of == 64
    assert resolved(TrainConfig(compile=True, dtype="fp32", pad_to_multiple_of=8), cpu).pad_to_multiple_of == 8


def test_padding_to_a_multiple_leaves_loss_and_gradients_unchanged(tiny):
    gen = torch.Generator().manual_seed(0)
    examples = []
    for n, prompt in ((11, 5), (7, 3), (30, 12)):
        ids = torch.randint(3, 100, (n,), generator=gen).tolist()
        examples.append({"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]})
    batch = collate(examples, pad_id=0)
    assert compiled.padded_to_multiple(batch, TrainConfig()) is batch  # no multiple: today's batch, untouched
    assert compiled.padded_to_multiple(batch, TrainConfig(pad_to_multiple_of=1)) is batch
    padded = compiled.padded_to_multiple(batch, TrainConfig(compile=True, max_length=96, pad_to_multiple_of=64))
    assert padded["input_ids"].shape == (3, 64) and batch["input_ids"].shape == (3, 30)
    assert padded["attention_mask"][:, 30:].eq(0).all() and padded["labels"][:, 30:].eq(IGNORE_INDEX).all()
    assert all(torch.equal(padded[k][:, :30], batch[k]) for k in batch)
    for loss in (supervised_positions_loss, all_positions_loss):
        grads = []
        for b in (batch, padded):
            tiny.zero_grad(set_to_none=True)
            value = loss(tiny, b)
            value.backward()
            grads.append((value.item(), {n: p.grad.clone() for n, p in tiny.named_parameters() if p.requires_grad}))
        (a, ga), (b, gb) = grads
        assert a == pytest.approx(b, abs=1e-6)
        assert ga.keys() == gb.keys() and all(torch.allclose(ga[n], gb[n], atol=1e-6, rtol=0) for n in ga)


def test_layers_are_compiled_only_inside_training_and_reused(tiny, eager_backend):
    layers = compiled.repeated_blocks(tiny)
    assert [type(x).__name__ for x in layers] == ["LlamaDecoderLayer"] * 2
    keys = list(tiny.state_dict())
    ids = torch.randint(3, 100, (2, 48), generator=torch.Generator().manual_seed(0))  # not the hidden size (64): dynamo
    cfg = TrainConfig(compile=True)  # would specialize a width equal to a fixed size of the same tensor
    with compiled.compiled_training(tiny, cfg):
        assert all(x._compiled_call_impl is not None for x in layers)
        assert list(tiny.state_dict()) == keys  # in place: no _orig_mod. prefixes
        first = [x._compiled_call_impl for x in layers]
        tiny(input_ids=ids)
        graphs = eager_backend["stats"]["unique_graphs"]
        for width in (37, 90, 5):  # on a CPU one graph takes every width (dynamic=True): nothing recompiles
            tiny(input_ids=ids.repeat(1, 2)[:, :width])
        assert eager_backend["stats"]["unique_graphs"] == graphs
    assert graphs >= 1
    assert all(x._compiled_call_impl is None for x in layers)  # evaluation, generation and export run eagerly
    tiny(input_ids=ids)
    assert eager_backend["stats"]["unique_graphs"] == graphs
    with compiled.compiled_training(tiny, cfg):  # the next client: the same compiled calls, no new graph
        assert [x._compiled_call_impl for x in layers] == first
        tiny(input_ids=ids)
    assert eager_backend["stats"]["unique_graphs"] == graphs
    with pytest.raises(ValueError, match="cudagraphs needs the model on a GPU"), \
            compiled.compiled_training(tiny, TrainConfig(compile="cudagraphs")):
        pass


@pytest.fixture
def fused_everywhere(monkeypatch):
    """The eager run computes what a compiled run on a CPU does: every batch fuses its head's loss (the compiled
    run's chunk compiled too) and AdamW is fused."""
    from fedllm.engine import client
    from fedllm.models import supervised_loss

    monkeypatch.setattr(supervised_loss, "FUSE_FROM_BYTES", 0)
    monkeypatch.setattr(client, "adamw_kernel", lambda params, cfg: {"fused": True})


def test_a_hook_added_between_clients_compiles_anew_and_runs(tiny, eager_backend, monkeypatch):
    """dynamo does not guard hooks; fedllm compares the layers' hooks at each client and compiles anew when they
    changed, so the next client's graph runs the hook (its output equals the eager model's with the hook).

    Under ``cudagraphs`` (the GPU check bypassed: the eager backend captures no CUDA graph), the same two clients
    check one ``cudagraph_mark_step_begin`` per forward pass (per micro-batch), outside the compiled graphs, none
    after the client's training."""
    marks = []
    monkeypatch.setattr(compiled, "on_gpu", lambda device: True)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(torch.compiler.is_compiling()))
    ids = torch.randint(3, 100, (2, 48), generator=torch.Generator().manual_seed(0))
    cfg = TrainConfig(compile="cudagraphs")
    layers = compiled.repeated_blocks(tiny)
    with torch.no_grad(), compiled.compiled_training(tiny, cfg):
        tiny(input_ids=ids)
        tiny(input_ids=ids)
        first = [x._compiled_call_impl for x in layers]
    assert marks == [False, False]  # called eagerly, outside the compiled layers
    proj = layers[0].self_attn.q_proj
    handle = proj.register_forward_hook(lambda module, args, output: output * 3)
    try:
        with torch.no_grad():
            eager = tiny(input_ids=ids).logits
            assert marks == [False, False]  # none outside a client's training
            with compiled.compiled_training(tiny, cfg):
                assert all(x._compiled_call_impl is not f for x, f in zip(layers, first))
                assert torch.equal(tiny(input_ids=ids).logits, eager)
            assert marks == [False, False, False]
    finally:
        handle.remove()


def test_a_compiled_run_equals_the_eager_run_bit_for_bit(tiny_recipe, ragged_file, tmp_path, eager_backend,
                                                         fused_everywhere):
    from fedllm.engine.server import run
    from fedllm.recipe.checks import parse_recipe

    finals = {}
    for name, train in (("eager", {}), ("compiled", {"compile": True})):  # on a CPU: the same unpadded batches
        recipe = parse_recipe(tiny_recipe(output_dir=str(tmp_path / name), data={"path": str(ragged_file)},
                                          train={"max_length": 96, **train}))
        out = run(recipe)
        finals[name] = {f.name: load_file(str(f)) for f in (out.run_dir / "final").glob("*.safetensors")}
        summary = json.loads((out.run_dir / "summary.json").read_text())
        assert summary["compile"]["pad_to_multiple_of"] == 1
    assert summary["compile"] == {"compile": True, "backend": "eager", "mode": None, "dynamic": True,
                                  "pad_to_multiple_of": 1}
    assert eager_backend["stats"]["unique_graphs"] >= 2  # the layers and the loss's chunk went through dynamo
    a, b = finals["eager"], finals["compiled"]
    assert a.keys() == b.keys() and "adapter.safetensors" in a
    for f in a:
        assert a[f].keys() == b[f].keys() and not any("_orig_mod" in k for k in b[f])
        assert all(torch.equal(a[f][k], b[f][k]) for k in a[f]), f


def test_a_compiled_packed_run_equals_the_eager_packed_run_on_a_cpu(tiny_recipe, ragged_file, tmp_path,
                                                                    eager_backend, fused_everywhere):
    """train.packing with train.compile on a CPU: packed rows of every width through one graph, the same bits."""
    from fedllm.engine.server import run
    from fedllm.recipe.checks import parse_recipe

    finals = {}
    for name, train in (("eager", {}), ("compiled", {"compile": True})):
        recipe = parse_recipe(tiny_recipe(output_dir=str(tmp_path / name), data={"path": str(ragged_file)},
                                          train={"max_length": 96, "packing": True, **train}))
        out = run(recipe)
        finals[name] = load_file(str(out.run_dir / "final" / "adapter.safetensors"))
    assert eager_backend["stats"]["unique_graphs"] >= 1
    a, b = finals["eager"], finals["compiled"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_compiled_run_resumes_bit_exactly(tiny_recipe, ragged_file, tmp_path, eager_backend, fused_everywhere,
                                            crash_at_round):
    """A compiled run cut in round 2 and resumed compiled ends where the uninterrupted run ends: the eager run of the
    same recipe, which test_a_compiled_run_equals_the_eager_run_bit_for_bit shows a compiled run equals (one
    compiled run fewer)."""
    from fedllm.engine.server import run
    from fedllm.recipe.checks import parse_recipe

    def recipe(name, compile=True):
        return parse_recipe(tiny_recipe(output_dir=str(tmp_path / name), data={"path": str(ragged_file)},
                                        train={"max_length": 96, "compile": compile},  # 2 rounds: cut in round 2
                                        checkpoint={"every": 1}))

    full = run(recipe("full", compile=False))
    cut = recipe("cut")
    crash_at_round(2)
    with pytest.raises(RuntimeError, match="power cut"):
        run(cut)
    crash_at_round(None)
    resumed = run(cut, resume=True)
    a = load_file(str(full.run_dir / "final" / "adapter.safetensors"))
    b = load_file(str(resumed.run_dir / "final" / "adapter.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


REFUSED = [
    ({"train": {"compile": "cudagraphs"}}, "train.compile", "model.device_map: null (CUDA graphs need"),
    ({"train": {"compile": "cudagraphs", "grad_accum": 2}, "model": {"name": "tiny-llama", "device_map": "cuda"}},
     "train.compile", "with train.grad_accum: 2"),
    ({"train": {"compile": True, "packing": True}, "model": {"name": "tiny-llama", "device_map": "cuda"}},
     "train.compile", "false with train.packing and model.device_map: cuda"),
    ({"train": {"compile": True, "clients_per_pass": 2}}, "train.compile", "false with train.clients_per_pass: 2"),
    ({"train": {"compile": True}, "privacy": {"mechanism": "dp_sgd", "noise_multiplier": 1.0}}, "train.compile",
     "false with privacy.mechanism: dp_sgd"),
    ({"train": {"compile": 1}}, "train.compile", "false, true or cudagraphs"),
    ({"train": {"pad_to_multiple_of": 0}}, "train.pad_to_multiple_of", "a positive integer"),
    ({"train": {"pad_to_multiple_of": 64, "packing": True}}, "train.pad_to_multiple_of", "with train.packing"),
]


@pytest.mark.parametrize("section,key,why", REFUSED, ids=["cudagraphs-cpu", "cudagraphs-grad_accum", "packing", "clients_per_pass", "dp_sgd",
                                                          "integer", "zero", "pad-packing"])
def test_what_cannot_hold_is_refused_at_recipe_load(tiny_recipe, section, key, why):
    from fedllm.recipe.checks import parse_recipe
    from fedllm.recipe.schema import RecipeError

    with pytest.raises(RecipeError) as e:
        parse_recipe(tiny_recipe(**section), source="r.yaml")
    assert any(k == key and why in expected for k, _, expected in e.value.problems), e.value.problems
    parse_recipe(tiny_recipe(train={"compile": "cudagraphs"}, model={"name": "tiny-llama", "device_map": "cuda"}))


def test_the_cli_exits_2_naming_key_and_value(tiny_recipe, tmp_path, capsys):
    from fedllm.commands.cli import main

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(train={"compile": "cudagraphs"})))
    assert main(["train", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "train.compile" in err and "cudagraphs" in err and "device_map" in err
