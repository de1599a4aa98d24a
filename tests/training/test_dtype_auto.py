"""``train.dtype: auto`` (and ``model.dtype: auto``): bf16 where the device computes it natively, fp32 elsewhere; the
choice logged, in recipe.yaml and in summary.json, and a run identical to one that names the chosen dtypes."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from fedllm.models import hardware


def _cpu(monkeypatch, flags):
    monkeypatch.setattr(hardware, "cpu_info", lambda: ("Test CPU", set(flags)))


@pytest.mark.parametrize("flags,expected", [({"avx512f", "avx512_bf16"}, "bf16"), ({"amx_bf16", "amx_tile"}, "bf16"),
                                            ({"avx512f", "avx2"}, "fp32"), (set(), "fp32")])
def test_dtype_auto_on_a_cpu_follows_its_bf16_flags(monkeypatch, flags, expected):
    _cpu(monkeypatch, flags)
    dtype, why = hardware.auto_dtype(torch.device("cpu"))
    assert dtype == expected and why.startswith("Test CPU: ")
    assert why.startswith("Test CPU: none of the CPU flags") == (expected == "fp32")


@pytest.mark.parametrize("capability,expected", [((8, 0), "bf16"), ((9, 0), "bf16"), ((7, 5), "fp32"), ((6, 1), "fp32")])
def test_dtype_auto_on_a_gpu_needs_compute_capability_8(monkeypatch, capability, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    dtype, why = hardware.auto_dtype(torch.device("cuda:0"))
    assert dtype == expected and f"compute capability {capability[0]}.{capability[1]}" in why


def test_dtype_auto_resolves_both_keys_once(monkeypatch, tiny_recipe):
    from fedllm.recipe.checks import parse_recipe

    _cpu(monkeypatch, {"avx512_bf16"})
    recipe = parse_recipe(tiny_recipe(train={"dtype": "auto"}, model={"name": "tiny-llama", "dtype": "auto"}))
    assert hardware.resolve_auto_dtypes(recipe) == {"train": "bf16", "model": "bf16",
                                                    "auto": "Test CPU: CPU flags avx512_bf16"}
    _cpu(monkeypatch, set())  # resolved already: a second call changes nothing
    assert hardware.resolve_auto_dtypes(recipe)["train"] == "bf16"
    recipe = parse_recipe(tiny_recipe(train={"dtype": "fp32"}, model={"name": "tiny-llama", "dtype": "auto"}))
    _cpu(monkeypatch, {"avx512_bf16"})
    assert hardware.resolve_auto_dtypes(recipe) == {"train": "fp32", "model": "fp32", "auto": None}  # follows train


def test_dtype_auto_keeps_an_fp32_base_for_dora_merges(monkeypatch, tiny_recipe):
    """DoRA with a strategy that merges into the base needs an fp32 base (its merges are exact only there): auto
    keeps the weights fp32 and trains under bf16 autocast; an explicit bf16 base is refused at recipe load."""
    from fedllm.recipe.checks import parse_recipe
    from fedllm.recipe.schema import RecipeError

    _cpu(monkeypatch, {"avx512_bf16"})
    raw = tiny_recipe(train={"dtype": "auto"}, model={"name": "tiny-llama", "dtype": "auto"},
                      lora={"r": 4, "alpha": 8, "use_dora": True}, federation={"strategy": "frlora"})
    chosen = hardware.resolve_auto_dtypes(parse_recipe(raw))
    assert (chosen["train"], chosen["model"]) == ("bf16", "fp32")
    with pytest.raises(RecipeError, match="model.dtype: got 'bf16'; expected fp32 or auto with lora.use_dora"):
        parse_recipe({**raw, "model": {"name": "tiny-llama", "dtype": "bf16"}})


@pytest.mark.parametrize("flags,chosen", [({"avx512_bf16"}, "bf16"), (set(), "fp32")])
def test_dtype_auto_run_equals_the_named_dtype_and_says_so(tiny_recipe, tmp_path, monkeypatch, caplog, flags, chosen):
    from fedllm.engine.server import run
    from fedllm.recipe.checks import parse_recipe

    _cpu(monkeypatch, flags)
    with caplog.at_level(logging.INFO, logger="fedllm"):
        auto = run(parse_recipe(tiny_recipe(output_dir=str(tmp_path / "auto"), train={"dtype": "auto"},
                                            model={"name": "tiny-llama", "dtype": "auto"})))
    named = run(parse_recipe(tiny_recipe(output_dir=str(tmp_path / "named"), train={"dtype": chosen},
                                         model={"name": "tiny-llama", "dtype": chosen})))
    assert f"train.dtype: auto -> {chosen} (Test CPU: " in caplog.text
    summary = json.loads((auto.run_dir / "summary.json").read_text())
    assert summary["dtype"]["train"] == summary["dtype"]["model"] == chosen
    assert summary["dtype"]["auto"].startswith("Test CPU: ")
    assert summary["throughput"]["compute_dtype"] == chosen
    assert f"dtype: {chosen}" in (auto.run_dir / "recipe.yaml").read_text()
    base = auto.model.get_base_model().model.layers[0].mlp.up_proj.weight
    assert base.dtype == (torch.bfloat16 if chosen == "bf16" else torch.float32)
    a = load_file(str(auto.run_dir / "final" / "adapter.safetensors"))
    b = load_file(str(named.run_dir / "final" / "adapter.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_dtype_auto_dry_run_estimates_in_the_chosen_dtype(tiny_recipe, monkeypatch):
    from fedllm.commands.dry_run import untimed
    from fedllm.recipe.checks import parse_recipe

    _cpu(monkeypatch, {"avx512_bf16"})
    recipe = parse_recipe(tiny_recipe(train={"dtype": "auto"}, model={"name": "tiny-llama", "dtype": "auto"}))
    report = untimed(recipe, weights_missing="test")
    # activations traced in bf16: a bf16 residual stream, eager attention (a CPU in bf16 up to 256 positions)
    assert recipe.train.dtype == "bf16" and "eager attention, bfloat16 hidden states" in report.report()


def test_dtype_bf16_without_peft_input_casts_trains_the_same_bits(tiny_recipe, monkeypatch):
    """Under bf16 autocast with a bf16 base and fp32 LoRA factors, skipping PEFT's cast of each LoRA input to fp32
    (autocast casts it back for the matmul) changes no bit of the loss or the trained factors."""
    from fedllm.data.collate import collate
    from fedllm.engine import client
    from fedllm.engine.server import build_federation
    from fedllm.models.loading import read_state
    from fedllm.recipe.checks import parse_recipe

    fed = build_federation(parse_recipe(tiny_recipe(train={"dtype": "bf16"}, model={"name": "tiny-llama",
                                                                                    "dtype": "bf16"})))
    model, strategy = fed.loaded.model, fed.strategy
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    start = read_state(model, fed.global_keys)
    results, seen = {}, []
    lora_a = next(m for n, m in model.named_modules() if n.endswith("lora_A.default"))
    lora_a.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    for skip in (True, False):
        monkeypatch.setattr(client, "SKIP_LORA_INPUT_CASTS", skip)
        plan = strategy.configure_client(1, 0, start)
        plan.lr = 1e-2
        results[skip] = client.train_client(model, plan, strategy, fed.data.examples, fed.data.clients[0],
                                            fed.recipe.train, lambda items: collate(items, fed.loaded.tokenizer.pad_token_id), seed=3)
    half = len(seen) // 2  # the LoRA input stays bf16 without PEFT's cast, fp32 with it
    assert set(seen[:half]) == {torch.bfloat16} and set(seen[half:]) == {torch.float32}
    assert results[True].loss == results[False].loss
    assert all(torch.equal(results[True].state[k], results[False].state[k]) for k in results[True].state)
    assert any(not torch.equal(results[True].state[k], start[k]) for k in start)  # it trained


@pytest.mark.parametrize("dtype,max_length,expected", [("bf16", 64, "eager"), ("bf16", 512, "fedllm_blocked_causal"),
                                                       ("fp32", 64, "sdpa")])
def test_dtype_bf16_cpu_training_takes_eager_attention_at_short_lengths(tiny_recipe, monkeypatch, dtype, max_length,
                                                                        expected):
    """On a CPU under bf16 autocast up to EAGER_ATTENTION_MAX_LENGTH positions the decoder trains with eager attention
    (SDPA's flash backward is slow there), past it with fedllm's blocked causal attention; outside training, and in
    fp32, the model keeps SDPA."""
    from fedllm.data.collate import collate
    from fedllm.engine import client
    from fedllm.engine.server import build_federation
    from fedllm.models.loading import read_state
    from fedllm.recipe.checks import parse_recipe

    fed = build_federation(parse_recipe(tiny_recipe(train={"dtype": dtype, "max_length": max_length})))
    config = fed.loaded.model.get_base_model().config
    seen = []
    original = client.micro_batch_loss
    monkeypatch.setattr(client, "micro_batch_loss", lambda *a: seen.append(config._attn_implementation) or original(*a))
    plan = fed.strategy.configure_client(1, 0, read_state(fed.loaded.model, fed.global_keys))
    plan.lr = 1e-2

    client.train_client(fed.loaded.model, plan, fed.strategy, fed.data.examples, fed.data.clients[0], fed.recipe.train,
                        lambda items: collate(items, fed.loaded.tokenizer.pad_token_id), seed=0)
    assert seen and set(seen) == {expected}
    assert config._attn_implementation == "sdpa"  # restored


def test_dtype_auto_is_the_default_and_client_functions_resolve_it(tiny_recipe, monkeypatch):
    from fedllm.engine.client import resolved
    from fedllm.recipe.checks import parse_recipe
    from fedllm.recipe.schema import TrainConfig

    raw = tiny_recipe()
    del raw["train"]["dtype"]  # the shared test recipe pins fp32
    recipe = parse_recipe(raw)
    assert (recipe.train.dtype, recipe.model.dtype) == ("auto", "auto")
    _cpu(monkeypatch, {"avx512_bf16"})
    assert resolved(TrainConfig(), torch.device("cpu")).dtype == "bf16"
    _cpu(monkeypatch, set())
    assert resolved(TrainConfig(), torch.device("cpu")).dtype == "fp32"
    assert resolved(TrainConfig(dtype="fp16"), torch.device("cpu")).dtype == "fp16"
