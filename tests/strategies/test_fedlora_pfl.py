"""FedLoRA (seed 002, Alg. 1; pFedLoRA(1)/(2) of seed 003 App. C.4): shared σ + private τ_i = B_i A_i."""

from functools import partial

import pytest
import torch
from strategy_helpers import make_raw, make_strategy, tiny

from fedllm.data.collate import collate
from fedllm.engine.client import BatchStream
from fedllm.engine.server import build_federation, run
from fedllm.models.loading import read_state
from fedllm.recipe.checks import parse_recipe
from fedllm.recipe.schedule import derived_seed
from fedllm.strategies.fedlora_pfl import FedLoRAPFL


def test_sigma_is_the_full_target_weights_or_the_shared_adapter():
    model = tiny().model
    full = make_strategy("fedlora_pfl", model)
    keys = full.global_keys(model)
    assert keys and all(k.endswith("base_layer.weight") for k in keys)
    assert len(keys) == len(full.private_layers) and full.modifies_base
    model = tiny().model
    lora = make_strategy("fedlora_pfl", model, shared="lora")
    assert set(lora.global_keys(model)) == {n for n, p in model.named_parameters() if "lora_" in n}
    assert not lora.modifies_base
    # τ: rank lora.r by default, A Gaussian and B zero at init (τ = 0), never among σ's keys
    tau = lora.personal_state(0, {})
    assert set(tau) == set(lora.private_keys) and set(tau).isdisjoint(lora.global_keys(model))
    assert all(torch.count_nonzero(v) == 0 for k, v in tau.items() if k.endswith(".L"))
    assert all(v.shape[0] == 8 for k, v in tau.items() if k.endswith(".U"))  # unit_recipe: lora.r = 8


def test_rank_ratio_gives_r_l_of_min_in_out_per_layer():
    model = tiny().model
    strategy = make_strategy("fedlora_pfl", model, rank_ratio=0.25)
    ranks = {name: getattr(layer.module, "fedlora").U.shape[0] for name, layer in strategy.private_layers.items()}
    # tiny-llama: q/o are 64×64 -> 16; k/v are 32×64 -> 8
    assert {n.rsplit(".", 1)[1]: r for n, r in ranks.items()} == {"q_proj": 16, "o_proj": 16, "k_proj": 8, "v_proj": 8}


def test_bad_arguments_are_named():
    problems = {k for k, _, _ in FedLoRAPFL.check_args(
        {"shared": "half", "schedule": "both", "rank": 4, "rank_ratio": 0.1, "e_lora": -1, "alpha": 0})}
    assert problems == {"shared", "schedule", "rank_ratio", "e_lora", "alpha"}
    assert {k for k, _, _ in FedLoRAPFL.check_args({"e_lora": 0, "e_global": 0})} == {"e_global"}
    assert {k for k, _, _ in FedLoRAPFL.check_args({"unit": "epochs", "e_lora": 0.5})} == set()
    assert {k for k, _, _ in FedLoRAPFL.check_args({"e_lora": 0.5})} == {"e_lora"}


def test_schedules_make_the_papers_phases():
    model = tiny().model
    alt = make_strategy("fedlora_pfl", model, e_lora=3, e_global=5)
    state = read_state(model, alt.global_keys(model))
    plan = alt.configure_client(1, 0, state)
    assert [(p.name, p.steps) for p in plan.phases] == [("personal", 3), ("global", 5)]
    assert set(plan.phases[0].keys) == set(alt.private_keys) and set(plan.phases[1].keys) == set(state)
    model = tiny().model
    sim = make_strategy("fedlora_pfl", model, e_lora=3, e_global=5, schedule="simultaneous")
    plan = sim.configure_client(1, 0, read_state(model, sim.global_keys(model)))
    assert [(p.name, p.steps) for p in plan.phases] == [("joint", 8)]  # eq. 86: E = E_per + E_global
    assert set(plan.phases[0].keys) == set(sim.private_keys) | set(state)


@pytest.mark.parametrize("args, phases", [
    ({}, [("personal", 3), ("global", 3)]),  # E = 6 split evenly
    ({"lora_share": 0.25}, [("personal", 2), ("global", 4)]),  # ⌊0.25·6 + ½⌋ = 2
    ({"e_lora": 4}, [("personal", 4), ("global", 2)]),  # E_global = E − E_lora (the paper's sweep)
    ({"e_global": 5}, [("personal", 1), ("global", 5)]),
    ({"e_lora": 0}, [("global", 6)]),  # FedAvg of σ at the same budget
    ({"e_lora": 4, "e_global": 7}, [("personal", 4), ("global", 7)]),  # explicit per-phase counts
    ({"schedule": "simultaneous"}, [("joint", 6)]),
])
def test_the_phases_share_one_budget(args, phases):
    """Seed 002 §3.4: ``E_lora + E_global = E``, E = the recipe's local steps (issue #23.2)."""
    from fedllm.recipe.checks import parse_recipe as parse

    model = tiny().model
    recipe = parse({"data": {"path": "unused.jsonl"}, "train": {"local_steps": 6},
                    "federation": {"num_clients": 3}})
    strategy = make_strategy("fedlora_pfl", model, recipe=recipe, **args)
    plan = strategy.configure_client(1, 0, read_state(model, strategy.global_keys(model)))
    assert [(p.name, p.steps) for p in plan.phases] == phases


def test_a_round_trains_the_recipes_budget(data_files, tmp_path):
    """With the defaults every client of a round takes ``train.local_steps`` optimizer steps in all, as under
    FedAvg (before #23.2 each phase took the whole budget: 2× the steps)."""
    result = run(parse_recipe(make_raw(data_files, tmp_path / "run", "fedlora_pfl", train={"local_steps": 4},
                                       federation={"rounds": 1})))
    fedavg = run(parse_recipe(make_raw(data_files, tmp_path / "avg", "fedavg", train={"local_steps": 4},
                                       federation={"rounds": 1})))
    assert result.history[0]["client_steps"] == fedavg.history[0]["client_steps"]
    assert set(result.history[0]["client_steps"].values()) == {4}


def test_epochs_are_passes_over_the_clients_data():
    model = tiny().model
    strategy = make_strategy("fedlora_pfl", model, unit="epochs", e_lora=1, e_global=0.5)
    plan = strategy.configure_client(1, 2, read_state(model, strategy.global_keys(model)))
    # make_strategy: client 2 has 20 examples; unit_recipe: batch 4, grad_accum 1
    assert [p.steps for p in plan.phases] == [5, 3]


def test_alternating_phases_leave_the_other_part_bit_identical(data_files, tmp_path, monkeypatch):
    snapshots = []
    original = FedLoRAPFL.after_step

    def spy(self, model, plan):
        params = dict(model.named_parameters())
        snapshots.append((plan.client_id, {k: params[k].detach().clone() for k in [*plan.state, *self.private_keys]}))
        return original(self, model, plan)

    monkeypatch.setattr(FedLoRAPFL, "after_step", spy)
    raw = make_raw(data_files, tmp_path / "run", "fedlora_pfl", {"e_lora": 2, "e_global": 3},
                   federation={"rounds": 1})
    result = run(parse_recipe(raw))
    sigma_keys = [k for k in snapshots[0][1] if "fedlora" not in k]
    tau_keys = result.strategy.private_keys
    for cid in result.history[0]["clients"]:
        steps = [s for c, s in snapshots if c == cid]
        assert len(steps) == 5
        start_sigma = {k: steps[0][k] for k in sigma_keys}
        for s in steps[:2]:  # τ-phase: σ exactly as downloaded
            assert all(torch.equal(s[k], start_sigma[k]) for k in sigma_keys)
        initial_tau = result.strategy.personal_state(cid, {})
        assert all(not torch.equal(steps[1][k], initial_tau[k]) for k in tau_keys if k.endswith(".L"))
        for s in steps[2:]:  # σ-phase: τ exactly as the τ-phase left it
            assert all(torch.equal(s[k], steps[1][k]) for k in tau_keys)
        assert all(not torch.equal(steps[-1][k], start_sigma[k]) for k in sigma_keys)
        kept = result.clients.get(cid)
        assert all(torch.equal(kept[k], steps[-1][k]) for k in tau_keys)


def test_e_lora_zero_with_a_shared_adapter_is_fedavg(data_files, tmp_path):
    fedavg = run(parse_recipe(make_raw(data_files, tmp_path / "a", "fedavg", {"weighting": "uniform"})))
    fedlora = run(parse_recipe(make_raw(data_files, tmp_path / "b", "fedlora_pfl", {"shared": "lora", "e_lora": 0})))
    assert fedavg.global_state.keys() == fedlora.global_state.keys()
    assert all(torch.equal(fedavg.global_state[k], fedlora.global_state[k]) for k in fedavg.global_state)
    assert [h["client_loss"] for h in fedavg.history] == [h["client_loss"] for h in fedlora.history]


@pytest.mark.parametrize("weighting", ["uniform", "examples"])
def test_e_lora_zero_with_full_weights_is_fedavg_of_sigma(weighting, data_files, tmp_path):
    """One SGD step per client: σ̄ = σ⁰ − lr · Σ_k p_k ∇f_k(σ⁰), the gradient taken by plain autograd on W;
    ``p_k = 1/N`` by default (eq. 8's plain mean), ``n_k / Σ n`` with ``weighting: examples``."""
    lr = 0.05
    args = {"e_lora": 0} if weighting == "uniform" else {"e_lora": 0, "weighting": weighting}
    raw = make_raw(data_files, tmp_path / "run", "fedlora_pfl", args,
                   federation={"rounds": 1}, train={"optimizer": "sgd", "local_steps": 1, "lr": lr})
    recipe = parse_recipe(raw)
    result = run(recipe)
    fed = build_federation(recipe)  # a fresh copy of the initial model and data
    model = fed.loaded.model
    params = dict(model.named_parameters())
    sigma0 = read_state(model, fed.global_keys)
    coll = partial(collate, pad_id=fed.loaded.tokenizer.pad_token_id, task=fed.loaded.task)
    clients = result.history[0]["clients"]
    sizes = {c: len(fed.data.clients[c]) for c in clients}
    expected = {k: v.clone() for k, v in sigma0.items()}
    for cid in clients:
        seed = derived_seed(recipe.seed, 1, cid)
        batch = coll([fed.data.examples[i] for i in BatchStream(fed.data.clients[cid], 4, seed).next()])
        torch.manual_seed(seed)
        for k in sigma0:
            params[k].requires_grad_(True)
        grads = torch.autograd.grad(model(**batch).loss, [params[k] for k in sigma0])
        for k, g in zip(sigma0, grads, strict=True):
            p = 1 / len(clients) if weighting == "uniform" else sizes[cid] / sum(sizes.values())
            expected[k] -= lr * p * g
    for k in expected:
        assert torch.allclose(result.global_state[k], expected[k], atol=1e-6), k
        assert not torch.equal(result.global_state[k], sigma0[k])
    # τ never trained: every kept τ is its initial value
    for cid in clients:
        init = result.strategy.personal_state(cid, {})
        assert all(torch.equal(result.clients.get(cid)[k], init[k]) for k in init)


@pytest.mark.parametrize("shared", ["full", "lora"])
def test_personal_model_is_sigma_plus_tau(shared, data_files, tmp_path):
    from strategy_helpers import effective_weights

    from fedllm.models.loading import write_state

    raw = make_raw(data_files, tmp_path / "run", "fedlora_pfl", {"shared": shared, "schedule": "simultaneous",
                                                                 "alpha": 4.0, "rank": 2})
    result = run(parse_recipe(raw))
    model, strategy = result.model, result.strategy
    glob = effective_weights(model)
    cid = result.history[-1]["clients"][0]
    tau = strategy.personal_state(cid, result.clients.get(cid))
    write_state(model, tau)
    personal = effective_weights(model)
    strategy.clear_private()
    for name in glob:
        l, u = tau[f"{name}.fedlora.L"], tau[f"{name}.fedlora.U"]
        assert torch.allclose(personal[name] - glob[name], (4.0 / 2) * l @ u, atol=1e-6)


def test_a_rank_above_a_layer_is_an_input_error_naming_the_key(data_files, tmp_path):
    from fedllm.common.errors import InputError

    raw = make_raw(data_files, tmp_path / "run", "fedlora_pfl", {"rank": 40})  # k/v of tiny-llama are 32 × 64
    with pytest.raises(InputError, match="federation.strategy_args.rank: got 40"):
        build_federation(parse_recipe(raw))
