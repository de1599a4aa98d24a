"""LoRA's scaling moved onto the rank-r activation: the same bits as PEFT's own forward, output and gradients."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from fedllm.models.lora_scaling import exact_scaling, scaling_on_rank


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(48, 96)
        self.down = torch.nn.Linear(96, 40, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _model(r: int, alpha: float, dtype=torch.float32, **lora):
    torch.manual_seed(0)
    model = get_peft_model(TwoLayers(), LoraConfig(r=r, lora_alpha=alpha, target_modules=["up", "down"], **lora))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero: give the branch something to compute
                p.copy_(torch.randn(p.shape) * 0.1)
            elif "lora_" not in name:
                p.data = p.data.to(dtype)
    return model


def _output_and_grads(model, x, autocast: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    (out.float() ** 2).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(("r", "alpha", "dtype", "autocast"), [
    (8, 16, torch.float32, False), (4, 16, torch.float32, False), (8, 8, torch.float32, False),
    (8, 16, torch.bfloat16, True),  # bf16 base, fp32 factors, bf16 autocast: what train.dtype auto runs on a CPU
])
def test_same_bits_as_peft(r, alpha, dtype, autocast):
    model = _model(r, alpha, dtype)
    x = torch.randn(5, 7, 48, generator=torch.Generator().manual_seed(1)).to(dtype)
    peft_out, peft_grads = _output_and_grads(model, x, autocast)
    with scaling_on_rank(model):
        swapped = [m for m in model.modules() if "forward" in vars(m)]
        out, grads = _output_and_grads(model, x, autocast)
    assert len(swapped) == 2
    assert not any("forward" in vars(m) for m in model.modules())  # PEFT's forward again
    assert torch.equal(out, peft_out)
    assert grads.keys() == peft_grads.keys() and all(torch.equal(grads[k], peft_grads[k]) for k in grads)
    assert all(g.abs().sum() > 0 for g in grads.values())


def test_other_scalings_and_states_keep_peft_forward():
    model = _model(8, 12)  # s = 1.5: a product by it rounds, so PEFT's order stays
    with scaling_on_rank(model):
        assert not any("forward" in vars(m) for m in model.modules())
    model = _model(8, 16)
    x = torch.randn(3, 48)
    with torch.no_grad():
        with model.disable_adapter():
            plain = model(x)
        with scaling_on_rank(model), model.disable_adapter():
            assert torch.equal(model(x), plain)  # adapters off: PEFT's path (the base layer alone)
        assert not torch.equal(model(x), plain)  # the adapters do act when on


def test_exact_scaling():
    assert [exact_scaling(s) for s in (1, 2.0, 4, 64.0)] == [True] * 4
    assert [exact_scaling(s) for s in (0.5, 1.5, 3, 0, -2, "2")] == [False] * 6
