"""FedEx-LoRA: after aggregation the model computes W + mean_k s·B_k A_k exactly (to fp32 rounding),
while the adapter holds FedAvg's (B̄, Ā)."""

import pytest
import torch
from strategy_helpers import base_weight_keys, effective_weights, fake_round, make_raw, make_strategy, tiny

from fedllm.engine.server import run
from fedllm.models.loading import read_state
from fedllm.recipe.checks import parse_recipe

R, ALPHA = 4, 8
SIZES = {0: 10, 1: 20, 2: 30}


@pytest.mark.parametrize("residual", ["merge", "dense"])
def test_effective_weight_is_the_exact_mean_of_the_clients_updates(residual):
    model = tiny(r=R, alpha=ALPHA).model
    strategy = make_strategy("fedex_lora", model, residual=residual)
    state = read_state(model, strategy.global_keys(model))
    for rnd, sampled in ((1, [0, 1, 2]), (2, [0, 2])):
        before = effective_weights(model)
        start = dict(state)  # every client starts from (B̄, Ā) of the last round on the same base
        state, uploads = fake_round(strategy, model, state, rnd, sampled, noise=5e-2, sizes=SIZES)
        total = sum(SIZES[c] for c in sampled)
        after = effective_weights(model)
        for name, layer in strategy.layers.items():
            w = before[name] - (ALPHA / R) * start[layer.b_key] @ start[layer.a_key]  # the base the clients had
            mean = sum(SIZES[c] / total * (ALPHA / R) * uploads[c][layer.b_key] @ uploads[c][layer.a_key]
                       for c in sampled)
            assert torch.allclose(after[name], w + mean, atol=1e-6, rtol=0), (rnd, name)
            b_bar = sum(SIZES[c] / total * uploads[c][layer.b_key] for c in sampled)
            a_bar = sum(SIZES[c] / total * uploads[c][layer.a_key] for c in sampled)
            assert torch.allclose(state[layer.b_key], b_bar, atol=1e-7)
            assert torch.allclose(state[layer.a_key], a_bar, atol=1e-7)
            # FedAvg alone would be off by the residual, which is not negligible here
            assert (w + (ALPHA / R) * b_bar @ a_bar - (w + mean)).abs().max() > 1e-5
    assert strategy.modifies_base == (residual == "merge")
    assert bool(strategy.base_residuals()) == (residual == "dense")


def test_quantized_base_keeps_the_residual_in_fp32_beside_it(tmp_path):
    pytest.importorskip("bitsandbytes")
    from fedllm.models.loading import tiny_tokenizer

    tiny().model.merge_and_unload().save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    model = tiny(str(tmp_path), quantization="8bit").model
    stored = {k: v.clone() for k, v in read_state(model, base_weight_keys(model).values()).items()}
    strategy = make_strategy("fedex_lora", model)
    assert not strategy.modifies_base
    state = read_state(model, strategy.global_keys(model))
    w = effective_weights(model)  # B = 0 at init: the model computes its (dequantized) base
    state, uploads = fake_round(strategy, model, state, 1, [0, 1], noise=1e-3)
    after = effective_weights(model)
    for name, layer in strategy.layers.items():
        mean = sum(0.5 * (ALPHA / R) * uploads[c][layer.b_key] @ uploads[c][layer.a_key] for c in (0, 1))
        assert mean.abs().max() > 1e-4  # well above the tolerance, and far below 8-bit resolution
        assert torch.allclose(after[name], w[name] + mean, atol=1e-5, rtol=0)
    assert all(torch.equal(v, read_state(model, [k])[k]) for k, v in stored.items())  # 8-bit base untouched


def test_every_client_is_sent_the_residual(data_files, tmp_path):
    raw = make_raw(data_files, tmp_path / "run", "fedex_lora")
    result = run(parse_recipe(raw))
    layers = result.strategy.layers.values()
    lora = sum(4 * layer.rank * (layer.shape[0] + layer.shape[1]) for layer in layers)
    # K = 2 clients a round: the residual as [p_1 B_1, p_2 B_2, −B̄]·[A_1; A_2; Ā] (rank 3r) or dense, the smaller
    residual = sum(4 * min(layer.shape[0] * layer.shape[1], 3 * layer.rank * (layer.shape[0] + layer.shape[1]))
                   for layer in layers)
    for h in result.history:
        assert h["bytes_up"] == {str(c): lora for c in h["clients"]}
        assert h["bytes_down"] == {str(c): residual + (lora if c in h["clients"] else 0) for c in range(3)}
