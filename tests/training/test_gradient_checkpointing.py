"""train.gradient_checkpointing: the gradients of a step equal those without it, whatever the strategy hooks.

Each strategy below changes what a decoder layer computes through forward hooks on its LoRA layers (FRLoRA's dense
residual, pFedLoRU's private adapter, mFedLoRU's nested factors, Fed-SB's latent matrix, pFL^MF's factorised pieces
and its G capture on U, FlexLoRA's DoRA stacks) or trains one factor at a time (RoLoRA). Under checkpointing those
hooks run again in the backward's recompute; a whole run (2 rounds, 2 clients of 3, 2 AdamW steps each) must end
where the run without it ends: every tensor of the final adapter and base within 1e-6 relative in fp32 (on this CPU
they are equal bit for bit). The selective form (every 2nd layer) too, and one step's raw gradients, per layer.
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
    real = checkpointed._recompute

    def counted():
        calls.append(1)
        return real()

    monkeypatch.setattr(checkpointed, "_recompute", counted)
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
