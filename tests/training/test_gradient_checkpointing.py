"""train.gradient_checkpointing: the gradients of a step equal those without it, whatever the strategy hooks.

Each strategy below changes what a decoder layer computes through forward hooks on its LoRA layers (FRLoRA's dense
residual, pFedLoRU's private adapter, mFedLoRU's nested factors, Fed-SB's latent matrix, pFL^MF's factorised pieces
and its G capture on U, FlexLoRA's DoRA stacks) or trains one factor at a time (RoLoRA). Under checkpointing those
hooks run again in the backward's recompute; a whole run (2 rounds, 2 clients of 3, 2 AdamW steps each) must end
where the run without it ends: every tensor of the final adapter and base within 1e-6 relative in fp32 (on this CPU
they are equal bit for bit). The selective form (every 2nd layer) too, and one step's raw gradients, per layer.
Checkpointed layers under train.compile: tests/training/test_compile_strategies.py (FRLoRA, bit for bit).
"""

import pytest
import torch
from safetensors.torch import load_file

from fedllm.engine import checkpointed
from fedllm.engine.server import run
from fedllm.recipe.checks import parse_recipe
from fedllm.recipe.schema import TrainConfig

CASES = {
    "frlora": ("frlora", {}),  # residual hook (dense base updates)
    "pfedloru": ("pfedloru", {"personal_r": 2, "personal_steps": 1, "tau": 2}),  # private adapter hook
    "mfedloru": ("mfedloru", {}),  # nested factor hooks
    "fed_sb": ("fed_sb", {}),  # latent R on lora_A's output
    "pflmf": ("pflmf", {}),  # factorised pieces + G captured on a leaf copy of U
    "flexlora-ranks": ("flexlora", {"client_ranks": [2, 4, 3]}),  # kept stacks, per-client ranks
    "rolora": ("rolora", {}),  # requires_grad changing between rounds
}


def final_state(tiny_recipe, out_dir, strategy, args, lora=None, **train):
    recipe = parse_recipe(tiny_recipe(output_dir=str(out_dir), train=train, lora={"r": 4, "alpha": 8, **(lora or {})},
                                      federation={"num_clients": 3, "clients_per_round": 2, "rounds": 2,
                                                  "strategy": strategy, "strategy_args": args}))
    return {f.name: load_file(str(f)) for f in (run(recipe).run_dir / "final").glob("*.safetensors")}


def assert_close(a, b, rtol=1e-6):
    assert a.keys() == b.keys() and "adapter.safetensors" in a
    for f in a:
        assert a[f].keys() == b[f].keys()
        for k in a[f]:
            x, y = a[f][k].double(), b[f][k].double()
            scale = max(float(x.abs().max()), 1e-30)
            assert float((x - y).abs().max()) <= rtol * scale, f"{f}:{k}"


@pytest.fixture
def checkpoints_counted(monkeypatch):
    """How many layer recomputes the runs took (so a test cannot pass with checkpointing silently off)."""
    calls = []

    class Counted(checkpointed._Recompute):
        def __enter__(self):
            calls.append(1)
            return super().__enter__()

    monkeypatch.setattr(checkpointed, "_Recompute", Counted)
    return calls


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_checkpointed_run_ends_where_the_plain_run_ends(case, tiny_recipe, tmp_path, checkpoints_counted):
    strategy, args = CASES[case]
    plain = final_state(tiny_recipe, tmp_path / "plain", strategy, args)
    assert not checkpoints_counted
    every = final_state(tiny_recipe, tmp_path / "every", strategy, args, gradient_checkpointing=True)
    assert checkpoints_counted
    assert_close(plain, every)


def test_dora_and_selective_checkpointing(tiny_recipe, tmp_path, checkpoints_counted):
    """DoRA's magnitude (PEFT's DoRA layer inside the checkpointed layer) and every 2nd layer only (tiny LLaMA: 2
    layers, so layer 0 recomputed, layer 1 not)."""
    plain = final_state(tiny_recipe, tmp_path / "plain", "fedavg", {}, lora={"use_dora": True})
    selective = final_state(tiny_recipe, tmp_path / "k2", "fedavg", {}, lora={"use_dora": True},
                            gradient_checkpointing=2)
    assert checkpoints_counted
    assert_close(plain, selective)


def _grads(model, batch, cfg):
    from fedllm.engine.client import micro_batch_loss

    model.zero_grad(set_to_none=True)
    with checkpointed.checkpointed_training(model, cfg):
        micro_batch_loss(model, batch, cfg).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_one_steps_gradients_are_equal_and_the_model_is_restored(tiny_lm):
    """Raw gradients of every LoRA factor, with and without; after the context the layers are no longer
    checkpointed and the embedding's require-grad hook is gone (evaluation and export see the model as loaded)."""
    model, batch = tiny_lm
    model.train()
    plain = _grads(model, batch, TrainConfig(dtype="fp32"))
    ckpt = _grads(model, batch, TrainConfig(dtype="fp32", gradient_checkpointing=True))
    assert plain.keys() == ckpt.keys() and len(plain) == 16  # q, k, v, o x A, B x 2 layers
    for k in plain:
        assert float((plain[k] - ckpt[k]).abs().max()) <= 1e-6 * float(plain[k].abs().max()), k
    base = model.get_base_model()
    assert not base.is_activation_checkpointing
    assert getattr(base, "_require_grads_hook", None) is None


def test_transformers_before_the_rename_uses_the_old_names():
    """A transformers with only ``gradient_checkpointing_enable/disable`` and ``is_gradient_checkpointing`` (5.17, the
    lent GPU image's: docs/gpu.md ran the 7B rows through it) gets those; a recent one the ``activation_*`` names,
    not the deprecated aliases beside them."""
    class Before:  # transformers 5.17's names
        is_gradient_checkpointing = False

        def gradient_checkpointing_enable(self, kwargs=None, every_n_layers=1):
            return ("old enable", kwargs, every_n_layers)

        def gradient_checkpointing_disable(self):
            return "old disable"

    class After(Before):  # recent: the new names, the old ones kept as aliases
        is_activation_checkpointing = True

        def activation_checkpointing_enable(self, kwargs=None, every_n_layers=1):
            return ("new enable", kwargs, every_n_layers)

        def activation_checkpointing_disable(self):
            return "new disable"

    enable, disable, active = checkpointed._transformers_api(Before())
    assert enable({"use_reentrant": False}, every_n_layers=2) == ("old enable", {"use_reentrant": False}, 2)
    assert disable() == "old disable" and active is False
    enable, disable, active = checkpointed._transformers_api(After())
    assert enable() == ("new enable", None, 1) and disable() == "new disable" and active is True


@pytest.fixture
def tiny_lm():
    from fedllm.models.loading import load_model
    from fedllm.recipe.schema import LoraConfig, ModelConfig

    loaded = load_model(ModelConfig(name="tiny-llama", dtype="fp32"), LoraConfig(r=4, alpha=8))
    tok = loaded.tokenizer
    torch.manual_seed(0)
    ids = torch.randint(3, len(tok), (2, 24))
    labels = ids.clone()
    labels[:, :8] = -100
    return loaded.model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


DP_SGD = {"mechanism": "dp_sgd", "noise_multiplier": 0.8, "clipping_norm": 0.5, "delta": 1e-3, "noise_seed": 5}
SECTIONS = {
    "dp-sgd-hooks": {"privacy": DP_SGD},
    "dp-sgd-ghost": {"privacy": {**DP_SGD, "grad_sample_mode": "ghost"}},
    "central-dp": {"privacy": {"mechanism": "central", "noise_multiplier": 0.5, "clipping_norm": 0.05,
                               "noise_seed": 3}},
    "packing": {"train": {"packing": True}},
    "clients-per-pass": {"train": {"clients_per_pass": 2}},
    "scaffold-grad-accum": {"federation": {"strategy": "scaffold"}, "train": {"grad_accum": 2, "max_grad_norm": 0.5}},
}


def run_sections(tiny_recipe, out_dir, sections, **train):
    raw = tiny_recipe(output_dir=str(out_dir), **{k: v for k, v in sections.items() if k != "train"})
    raw["train"] = {**raw["train"], **sections.get("train", {}), **train}
    result = run(parse_recipe(raw))
    return result, {f.name: load_file(str(f)) for f in (result.run_dir / "final").glob("*.safetensors")}


@pytest.mark.parametrize("case", sorted(SECTIONS))
def test_privacy_packing_and_batching_under_checkpointing(case, tiny_recipe, tmp_path, checkpoints_counted):
    """DP-SGD (opacus records each LoRA input once: not again in the recompute), client-level DP, packed rows,
    clients trained together in one pass, SCAFFOLD's correction with accumulation and clipping."""
    plain, a = run_sections(tiny_recipe, tmp_path / "plain", SECTIONS[case])
    ckpt, b = run_sections(tiny_recipe, tmp_path / "ckpt", SECTIONS[case], gradient_checkpointing=True)
    assert checkpoints_counted
    assert_close(a, b)
    assert [h.get("epsilon") for h in plain.history] == [h.get("epsilon") for h in ckpt.history]


@pytest.mark.parametrize("reference", ["precomputed", "adapter_disabled"])
def test_dpo_under_checkpointing(reference, tmp_path, checkpoints_counted):
    """DPO on FRLoRA (its residual hook in the policy pass): the reference log-probabilities, computed once per
    client (precomputed) or with the adapter off at every step (under no_grad: nothing checkpointed), and the
    policy's checkpointed pass give the plain run's result."""
    from tests.conftest import tiny_raw, write_jsonl
    from tests.preference_helpers import preference_records

    data = write_jsonl(tmp_path / "pairs.jsonl", preference_records(24))
    strategy = "frlora" if reference == "precomputed" else "fedavg"  # adapter_disabled: a base that never changes
    finals = []
    for name, on in (("plain", False), ("ckpt", True)):
        raw = tiny_raw(tmp_path / name, data, data={"path": str(data), "format": "preference", "fields": {}},
                       federation={"num_clients": 3, "clients_per_round": 2, "rounds": 2, "strategy": strategy},
                       train={"objective": "dpo", "max_length": 48, "lr": 5e-2, "gradient_checkpointing": on,
                              "preference": {"reference": reference}})
        finals.append({f.name: load_file(str(f)) for f in (run(parse_recipe(raw)).run_dir / "final").glob(
            "*.safetensors")})
    assert checkpoints_counted
    assert_close(*finals)


def test_resume_is_bit_exact_and_the_key_may_change(tiny_recipe, tmp_path):
    """A checkpointed FRLoRA run cut in round 3 and resumed without checkpointing ends where the uncut run
    without it ends, bit for bit (the key changes memory and compute, not the result: a safe key on --resume)."""
    from fedllm.engine.server import RoundLoop
    from tests.conftest import crashing_round

    fed = {"num_clients": 3, "clients_per_round": 2, "rounds": 3, "strategy": "frlora"}
    cut = tiny_recipe(output_dir=str(tmp_path / "cut"), federation=fed, checkpoint={"every": 1})
    cut["train"] = {**cut["train"], "gradient_checkpointing": True, "optimizer_state": "per_client"}
    whole_raw = {**cut, "output_dir": str(tmp_path / "whole"), "train": {**cut["train"], "gradient_checkpointing":
                                                                          False}}
    whole = run(parse_recipe(whole_raw))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RoundLoop, "run_round", crashing_round(RoundLoop.run_round, 3))
        with pytest.raises(RuntimeError, match="power cut"):
            run(parse_recipe(cut))
    resumed = run(parse_recipe({**cut, "train": {**cut["train"], "gradient_checkpointing": False}}), resume=True)
    for part in ("adapter", "base", "clients"):
        a = load_file(str(whole.run_dir / "final" / f"{part}.safetensors"))
        b = load_file(str(resumed.run_dir / "final" / f"{part}.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part
    assert "train.gradient_checkpointing" in (resumed.run_dir / "metrics.jsonl").read_text()  # the change, logged


@pytest.mark.parametrize("given", [0, -2, "yes", 1.5])
def test_a_bad_value_is_refused_at_recipe_load(given, tiny_recipe, tmp_path):
    from fedllm.recipe.schema import RecipeError

    raw = tiny_recipe()
    raw["train"] = {**raw["train"], "gradient_checkpointing": given}
    with pytest.raises(RecipeError) as e:
        parse_recipe(raw)
    assert [(k, g) for k, g, _ in e.value.problems] == [("train.gradient_checkpointing", given)]
    assert "true" in e.value.problems[0][2]


def test_a_model_that_cannot_checkpoint_is_refused_naming_the_key():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="train.gradient_checkpointing: Sequential does not support"), \
            checkpointed.checkpointed_training(model, TrainConfig(gradient_checkpointing=True)):
        pass
