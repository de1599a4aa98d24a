"""FRLoRA (seed 001, Alg. 1) and its ablations v1/v2/v3 against independent computations."""

import pytest
import torch
from strategy_helpers import base_weight_keys, effective_weights, fake_round, make_strategy, tiny, unit_recipe

from fedllm.models.loading import lora_layers, read_state
from fedllm.models.state import DTYPES, num_bytes

R, ALPHA = 4, 8
S = ALPHA / R


def logits(model, classification=False):
    ids = torch.tensor([[3, 17, 42, 7, 99, 5, 21, 8]])
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def best_rank_r(w, r=R):
    u, s, vh = torch.linalg.svd(w.double(), full_matrices=False)
    return ((u[:, :r] * s[:r]) @ vh[:r]).float()


def factor_keys(model):
    layers = lora_layers(model)
    return {n: (f"{n}.lora_B.default.weight", f"{n}.lora_A.default.weight") for n in layers}


@pytest.mark.parametrize("family,svd", [("tiny-llama", "exact"), ("tiny-llama", "randomized"), ("tiny-roberta", "exact")])
def test_init_leaves_the_outputs_unchanged_and_the_base_is_w0_minus_s_b0a0(family, svd):
    model = tiny(family).model
    w0 = effective_weights(model)
    before = logits(model)
    strategy = make_strategy("frlora", model, svd=svd)
    assert torch.allclose(logits(model), before, atol=1e-5)
    params = dict(model.named_parameters())
    for name, base_key in base_weight_keys(model).items():
        b_key, a_key = factor_keys(model)[name]
        b0, a0 = params[b_key].detach(), params[a_key].detach()
        assert torch.allclose(params[base_key].detach(), w0[name] - S * b0 @ a0, atol=1e-6)
        if svd == "exact":  # s·B0A0 is the best rank-r approximation of W0; both Gram matrices are diag(S_r/s)
            assert torch.allclose(S * b0 @ a0, best_rank_r(w0[name]), atol=1e-5)
            sv = torch.linalg.svdvals(w0[name].double())[:R].float()
            assert torch.allclose(b0.T @ b0, torch.diag(sv / S), atol=1e-5)
            assert torch.allclose(a0 @ a0.T, torch.diag(sv / S), atol=1e-5)
        else:  # randomized: a rank-r reconstruction within 2% of the exact one's error (flat random spectra)
            err = torch.linalg.norm(w0[name] - S * b0 @ a0) / torch.linalg.norm(w0[name] - best_rank_r(w0[name]))
            assert 1.0 - 1e-4 <= float(err) < 1.02
    assert strategy.modifies_base and not strategy.base_residuals()


def test_rounds_merge_exactly_the_residuals_into_every_copy_and_restart_from_b0a0():
    model = tiny().model
    w0 = effective_weights(model)
    strategy = make_strategy("frlora", model)
    state = read_state(model, strategy.global_keys(model))
    start = {k: v.clone() for k, v in state.items()}
    total = {n: torch.zeros_like(w) for n, w in w0.items()}
    for rnd, sampled in ((1, [0, 2]), (2, [1, 2]), (3, [0, 1])):
        state, uploads = fake_round(strategy, model, state, rnd, sampled)
        for name, (b_key, a_key) in factor_keys(model).items():  # Eq. 3 (uniform), Eq. 9
            b_bar = sum(uploads[c][b_key] for c in sampled) / len(sampled)
            a_bar = sum(uploads[c][a_key] for c in sampled) / len(sampled)
            total[name] += S * (b_bar @ a_bar - start[b_key] @ start[a_key])
        assert all(torch.equal(state[k], start[k]) for k in state)  # clients restart from (B0, A0)
        # clients outside the round receive (B̄, Ā) to apply ΔW too (Table 14's Cost.NP)
        lora_bytes = num_bytes(start, "fp32")
        assert strategy.extra_download_bytes(rnd, sampled, 3, "fp32") == {({0, 1, 2} - set(sampled)).pop(): lora_bytes}
        assert strategy.extra_download_bytes(rnd, sampled, 3, "bf16")[({0, 1, 2} - set(sampled)).pop()] * 2 == lora_bytes
    final = effective_weights(model)  # W̃^T = Ŵ^T + s·B0A0 = W0 + Σ_t ΔW^t (Eq. 13)
    for name in w0:
        assert torch.allclose(final[name] - w0[name], total[name], atol=2e-6)
        assert torch.linalg.matrix_rank(total[name], rtol=1e-4) > R  # residual accumulation exceeds rank r


def test_v1_is_fedavg_from_the_principal_init():
    model = tiny().model
    strategy = make_strategy("frlora_v1", model)
    base = {k: v.clone() for k, v in read_state(model, base_weight_keys(model).values()).items()}
    state = read_state(model, strategy.global_keys(model))
    new, uploads = fake_round(strategy, model, state, 1, [0, 1])
    for k in new:
        assert torch.allclose(new[k], (uploads[0][k] + uploads[1][k]) / 2, atol=1e-7)
    assert all(torch.equal(v, read_state(model, [k])[k]) for k, v in base.items())  # nothing merged
    assert strategy.extra_download_bytes(1, [0, 1], 3, "fp32") == {}


def _looks_gaussian_with_std(a, std):
    """B = 0, A ~ N(0, std²): sample std within 15 %, about 68 % within one std, and values beyond
    the bound a Kaiming-uniform draw (PEFT's default, bound 1/√in) could reach."""
    x = a.flatten().double()
    kaiming_bound = 1 / a.shape[1] ** 0.5
    within = float((x.abs() < std).double().mean())
    return abs(float(x.std()) / std - 1) < 0.15 and abs(within - 0.6827) < 0.08 and float(x.abs().max()) > kaiming_bound


def test_v2_merges_s_bbar_abar_and_reinits_with_zero_and_gaussian_noise():
    """Seed 001 §4.4 / App.: v2 re-initialises B to zero and A with Gaussian noise every round (PEFT's
    gaussian init: std 1/r), the initial adapter included."""
    model = tiny().model
    w0 = effective_weights(model)
    strategy = make_strategy("frlora_v2", model)
    assert torch.allclose(effective_weights(model)[next(iter(w0))], next(iter(w0.values())))  # base untouched
    state = read_state(model, strategy.global_keys(model))
    for b_key, a_key in factor_keys(model).values():
        assert torch.count_nonzero(state[b_key]) == 0
    a_all = torch.cat([state[a].flatten() for _, a in factor_keys(model).values()])
    assert _looks_gaussian_with_std(a_all.reshape(R, -1), 1 / R)
    total = {n: torch.zeros_like(w) for n, w in w0.items()}
    redrawn = []
    for rnd in (1, 2):
        previous = state
        state, uploads = fake_round(strategy, model, state, rnd, [0, 1])
        for name, (b_key, a_key) in factor_keys(model).items():
            total[name] += S * ((uploads[0][b_key] + uploads[1][b_key]) / 2) @ ((uploads[0][a_key] + uploads[1][a_key]) / 2)
            assert torch.count_nonzero(state[b_key]) == 0
            assert not torch.equal(state[a_key], previous[a_key])
            redrawn.append(state[a_key])
        a_all = torch.cat([state[a].flatten() for _, a in factor_keys(model).values()])
        assert _looks_gaussian_with_std(a_all.reshape(R, -1), 1 / R)
    final = effective_weights(model)
    for name in w0:
        assert torch.allclose(final[name] - w0[name], total[name], atol=2e-6)
    again = make_strategy("frlora_v2", tiny().model)  # the redraw is seeded: same on every client
    assert torch.equal(again._gaussian(next(iter(again.layers)), 1)[1], redrawn[0])


@pytest.mark.parametrize("name,drops", [("frlora", False), ("frlora_v1", False), ("frlora_v2", True),
                                        ("frlora_v3", True)])
def test_one_moment_rule_keeps_fixed_restarts_and_drops_redrawn_adapters(name, drops):
    model = tiny("tiny-roberta").model
    strategy = make_strategy(name, model)
    keys = list(read_state(model, strategy.global_keys(model)))
    factors = {k for k in keys if "lora_" in k}
    heads = set(keys) - factors
    assert factors and heads
    moments = {f"{k}::{m}": torch.ones(1) for k in keys for m in ("exp_avg", "exp_avg_sq")}
    kept = strategy.client_optimizer_state(2, 0, moments)
    kept_params = {k.split("::")[0] for k in kept}
    assert kept_params == (heads if drops else set(keys))         # a classifier head always keeps its moments
    assert strategy.client_optimizer_state(2, 0, None) is None


def test_v3_restarts_from_the_principal_factors_of_the_new_weight():
    model = tiny().model
    strategy = make_strategy("frlora_v3", model)
    state = read_state(model, strategy.global_keys(model))
    state, _ = fake_round(strategy, model, state, 1, [0, 2], noise=5e-2)
    weights = effective_weights(model)
    params = dict(model.named_parameters())
    for name, (b_key, a_key) in factor_keys(model).items():
        assert torch.allclose(S * state[b_key] @ state[a_key], best_rank_r(weights[name]), atol=2e-5)
        base_key = base_weight_keys(model)[name]
        assert torch.allclose(params[base_key].detach(), weights[name] - S * state[b_key] @ state[a_key], atol=2e-6)


def test_the_classifier_head_is_averaged_and_never_reset():
    model = tiny("tiny-roberta").model
    strategy = make_strategy("frlora", model)
    state = read_state(model, strategy.global_keys(model))
    heads = [k for k in state if "classifier" in k]
    assert heads
    new, uploads = fake_round(strategy, model, state, 1, [0, 1])
    for k in heads:
        assert torch.allclose(new[k], (uploads[0][k] + uploads[1][k]) / 2, atol=1e-7)
        assert not torch.equal(new[k], state[k])
    second, uploads = fake_round(strategy, model, new, 2, [1, 2])
    for k in heads:  # round 2 starts from the averaged head, not from the initial one
        assert torch.allclose(second[k], (uploads[1][k] + uploads[2][k]) / 2, atol=1e-7)


def test_bf16_wire_init_is_exactly_representable_so_casting_changes_nothing():
    model = tiny().model
    before = logits(model)
    strategy = make_strategy("frlora", model, recipe=unit_recipe(comm_dtype="bf16"))
    state = read_state(model, strategy.global_keys(model))
    assert all(torch.equal(v, v.to(DTYPES["bf16"]).float()) for v in state.values())
    assert torch.allclose(logits(model), before, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from fedllm.models.loading import tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny-llama-dir")
    model = tiny().model.merge_and_unload()
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("bits", ["4bit", "8bit"])
def test_kbit_base_keeps_the_residual_beside_it_in_fp32(tiny_dir, bits):
    pytest.importorskip("bitsandbytes")
    model = tiny(str(tiny_dir), quantization=bits).model
    w0 = effective_weights(model)
    before = logits(model)
    stored = {k: v.clone() for k, v in read_state(model, base_weight_keys(model).values()).items()}
    strategy = make_strategy("frlora", model)
    assert not strategy.modifies_base and set(strategy.base_residuals()) == set(w0)
    assert torch.allclose(logits(model), before, atol=1e-4)
    state = read_state(model, strategy.global_keys(model))
    # a change far below 4/8-bit resolution survives: it is kept in fp32, the quantized base is untouched
    tiny_step = {k: v * (1 + 1e-4) for k, v in state.items()}
    from fedllm.strategies import ClientUpdate

    agg = strategy.aggregate(1, state, [ClientUpdate(0, tiny_step, 1, 0.0, 1)])
    strategy.after_aggregate(1, model, agg)
    from fedllm.models.loading import write_state

    write_state(model, state)  # back to (B0, A0): the model now computes W0 + ΔW
    after = effective_weights(model)
    for name, (b_key, a_key) in factor_keys(model).items():
        delta = S * (tiny_step[b_key] @ tiny_step[a_key] - state[b_key] @ state[a_key])
        assert delta.abs().max() > 0
        assert torch.allclose(after[name] - w0[name], delta, atol=1e-6, rtol=1e-3)
    assert all(torch.equal(v, read_state(model, [k])[k]) for k, v in stored.items())
