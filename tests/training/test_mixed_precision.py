"""train.dtype bf16/fp16: autocast on CPU (the same code path runs on a GPU) trains and stays close to fp32."""

import pytest
import torch

from fedllm.engine.client import micro_batch_loss, train_autocast
from fedllm.engine.server import run
from fedllm.models.loading import load_model, lora_layers
from fedllm.recipe.checks import parse_recipe
from fedllm.recipe.schema import LoraConfig, ModelConfig, TrainConfig


def _batch():
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :6] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("positions", ["supervised", "all"])
def test_autocast_runs_the_matmuls_in_half_precision(dtype, positions):
    model = load_model(ModelConfig(name="tiny-llama"), LoraConfig(r=4, alpha=8)).model
    seen = []
    layer = next(iter(lora_layers(model).values()))
    layer.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    cfg = TrainConfig(local_steps=1, dtype=dtype, loss_positions=positions)
    batch = _batch()
    with torch.no_grad():
        full = float(micro_batch_loss(model, batch, TrainConfig(local_steps=1, loss_positions=positions)))
        with train_autocast(torch.device("cpu"), dtype):
            half = micro_batch_loss(model, batch, cfg)
    assert seen == [torch.float32, {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]]
    assert half.dtype == torch.float32  # the cross-entropy runs in fp32
    assert abs(float(half) - full) < 2e-2 * abs(full)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_round_trains_under_autocast(tiny_recipe, dtype):
    result = run(parse_recipe(tiny_recipe(federation={"rounds": 1}, train={"dtype": dtype})))
    assert all(v.dtype == torch.float32 for v in result.global_state.values())
    assert any(torch.count_nonzero(v) > 0 for k, v in result.global_state.items() if "lora_B" in k)
    assert torch.isfinite(torch.tensor(result.history[-1]["train_loss"]))
