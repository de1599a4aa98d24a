"""pFL^MF (seed 004, Alg. 1): θ_i = U v_i, K local steps on v_i, the server steps U with G_i = ∇f_i(U v_i) v_iᵀ."""

from functools import partial

import pytest
import torch
from strategy_helpers import make_raw, tiny

from fedllm.data.collate import collate
from fedllm.engine.client import BatchStream, run_client
from fedllm.engine.server import build_federation
from fedllm.models.loading import read_state, write_state
from fedllm.recipe.checks import parse_recipe
from fedllm.runs.client_store import ClientStore
from fedllm.strategies.pflmf import U_KEY, V_KEY

ETA_V, ETA_U, K, SEED = 0.05, 0.5, 3, 1234


def one_client(data_files, tmp_path, classification=False, lora=None, **args):
    raw = make_raw(data_files, tmp_path, "pflmf", {"rank": 3, "eta_u": ETA_U, **args}, classification=classification,
                   federation={"num_clients": 1, "clients_per_round": 1},
                   train={"optimizer": "sgd", "local_steps": K, "lr": ETA_V}, **({"lora": lora} if lora else {}))
    recipe = parse_recipe(raw)
    return recipe, build_federation(recipe)


def reference(fed, recipe, u, v, seed):
    """Plain autograd on the un-factored θ = U v: K SGD steps on v and G = ∇f(θ⁰) v⁰ᵀ (no hooks, no store)."""
    model, strategy = fed.loaded.model, fed.strategy
    params = dict(model.named_parameters())
    names = [s.name for s in strategy.slices]
    coll = partial(collate, pad_id=fed.loaded.tokenizer.pad_token_id, task=fed.loaded.task)
    stream = BatchStream(fed.data.clients[0], recipe.train.batch_size, seed)
    torch.manual_seed(seed)  # the same dropout masks as the client's loop (tiny RoBERTa has dropout)
    g0 = None
    for _ in range(K):
        theta = u @ v  # flat θ in named_parameters order
        offset = 0
        with torch.no_grad():
            for n in names:
                p = params[n]
                p.copy_(theta[offset:offset + p.numel()].view(p.shape))
                offset += p.numel()
        batch = collate_batch(coll, fed, stream)
        for n in names:
            params[n].requires_grad_(True)
        loss = model(**batch).loss
        grads = torch.autograd.grad(loss, [params[n] for n in names])
        g = torch.cat([x.reshape(-1) for x in grads])
        if g0 is None:
            g0 = torch.outer(g, v)  # G = ∇f(U v⁰) v⁰ᵀ
        v = v - ETA_V * (u.T @ g)
    return v, g0


def collate_batch(coll, fed, stream):
    return coll([fed.data.examples[i] for i in stream.next()])


@pytest.mark.parametrize("classification,lora", [(False, None), (True, None), (False, {"use_dora": True})],
                         ids=["causal", "classification", "causal-dora"])
def test_one_client_plain_sgd_matches_autograd_on_theta(classification, lora, data_files, tmp_path):
    """The reference trains PEFT's own model with θ = U v written into its parameters (under DoRA: A, B and each
    layer's magnitude vector, through PEFT's DoRA forward and its detached column norm)."""
    recipe, fed = one_client(data_files, tmp_path, classification, lora)
    if lora:
        assert sum(".lora_magnitude_vector." in s.name for s in fed.strategy.slices) == len(
            [s for s in fed.strategy.slices if ".lora_A." in s.name])
    model, strategy = fed.loaded.model, fed.strategy
    global_state = read_state(model, fed.global_keys)
    u0 = global_state[U_KEY].clone()
    store = ClientStore()
    plan = strategy.configure_client(1, 0, global_state)
    plan.lr = ETA_V
    coll = partial(collate, pad_id=fed.loaded.tokenizer.pad_token_id, task=fed.loaded.task)
    update = run_client(model, plan, strategy, store, fed.data.examples, fed.data.clients[0], recipe.train, coll, SEED)
    new_global = strategy.aggregate(1, global_state, [update])
    assert set(update.state) == {U_KEY} and update.steps == K
    trained = model.training
    model.train()
    v_ref, g_ref = reference(fed, recipe, u0, strategy.v0(), SEED)
    model.train(trained)
    v_got = store.get(0)[V_KEY]
    assert not torch.equal(v_got, strategy.v0())
    assert torch.allclose(v_got, v_ref, rtol=1e-5, atol=1e-7), (v_got, v_ref)
    assert torch.allclose(update.state[U_KEY], g_ref, rtol=1e-4, atol=1e-8)
    assert torch.allclose(new_global[U_KEY], u0 - ETA_U * g_ref, rtol=1e-5, atol=1e-7)
    # v⁰ = e_1: G's columns other than the first are zero in the first round
    assert torch.count_nonzero(update.state[U_KEY][:, 1:]) == 0


def test_every_client_starts_at_the_usual_lora_init(data_files, tmp_path):
    recipe, fed = one_client(data_files, tmp_path)
    strategy = fed.strategy
    plain = tiny().model  # the same tiny model and LoRA init, no strategy attached
    init = {n: p for n, p in plain.named_parameters() if p.requires_grad}
    start = strategy.personal_state(0, {})
    assert set(start) == set(init) | {V_KEY}
    assert all(torch.equal(start[n], init[n]) for n in init)  # θ⁰ = U⁰ e_1, bit for bit
    assert all(torch.count_nonzero(init[n]) == 0 for n in init if "lora_B" in n)  # so the output is the base's
    u = strategy.factors.U
    assert u.shape == (strategy.d, 3) and strategy.d == sum(p.numel() for p in init.values())
    norms = u.norm(dim=0)  # the extra columns have ‖θ⁰‖ (init_scale 1)
    assert torch.allclose(norms, norms[0].expand(3), rtol=1e-5)


def test_eta_v_theorem_is_p_eta_u_over_k(data_files, tmp_path):
    raw = make_raw(data_files, tmp_path, "pflmf", {"rank": 2, "eta_u": 0.3, "eta_v": "theorem"},
                   federation={"num_clients": 3, "clients_per_round": 2}, train={"local_steps": 4})
    fed = build_federation(parse_recipe(raw))
    plan = fed.strategy.configure_client(1, 1, read_state(fed.loaded.model, fed.global_keys))
    plan.lr = 99.0
    fed.strategy.open_client(plan)
    fed.strategy.close_client(plan, {V_KEY: plan.local[V_KEY]}, 0)
    assert plan.lr == pytest.approx((2 / 3) * 0.3 / 4)


def test_bad_arguments_are_named():
    from fedllm.strategies.pflmf import PFLMF

    problems = {k: e for k, _, e in PFLMF.check_args({"rank": 0, "eta_v": "fast", "weighting": "x"})}
    assert set(problems) == {"rank", "eta_v", "weighting"}


def test_personal_models_differ_and_the_global_model_is_u_v0(data_files, tmp_path):
    from fedllm.engine.server import run

    raw = make_raw(data_files, tmp_path / "run", "pflmf", {"rank": 3, "eta_u": 0.5},
                   federation={"clients_per_round": 3}, train={"optimizer": "sgd", "lr": 0.05})
    result = run(parse_recipe(raw))
    strategy, model = result.strategy, result.model
    u = result.global_state[U_KEY]
    expected = strategy.materialise(u, strategy.v0())
    assert all(torch.equal(result.global_state[k], expected[k]) for k in expected)
    personal = [strategy.personal_state(c, result.clients.get(c)) for c in range(3)]
    for c, state in enumerate(personal):
        v = result.clients.get(c)[V_KEY]
        flat = torch.cat([state[s.name].reshape(-1) for s in strategy.slices])
        assert torch.allclose(flat, u @ v, atol=1e-6)
    keys = [s.name for s in strategy.slices]
    assert any(not torch.equal(personal[0][k], personal[1][k]) for k in keys)
    # bytes: U down, G_i up (d·r fp32 numbers each)
    ur = strategy.d * 3 * 4
    assert all(set(h["bytes_up"].values()) == {ur} and set(h["bytes_down"].values()) == {ur} for h in result.history)
    write_state(model, personal[0])  # loading a personal model needs nothing but its tensors


def test_fp16_training_is_refused_naming_the_key(data_files, tmp_path):
    from fedllm.common.errors import InputError

    raw = make_raw(data_files, tmp_path, "pflmf", {"rank": 2}, train={"dtype": "fp16"})
    with pytest.raises(InputError, match="train.dtype: got 'fp16'"):
        build_federation(parse_recipe(raw))
