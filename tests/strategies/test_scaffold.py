"""SCAFFOLD: the control variates follow Karimireddy et al. (2020) Alg. 1 (option II), computed by hand."""

import pytest
import torch
from strategy_helpers import make_raw, record_updates

from fedllm.data.collate import collate
from fedllm.engine.server import build_federation, run
from fedllm.models.loading import read_state, write_state
from fedllm.recipe.checks import parse_recipe
from fedllm.strategies.scaffold import DELTA_C, Scaffold


def test_variates_follow_the_papers_formulas_with_sgd(data_files, tmp_path):
    """One client per round, N = 2, plain SGD on full batches, two rounds: the run's x, c and c_i equal
    the paper's ``y ← y − lr(g(y) − c_i + c)``, ``c_i⁺ = c_i − c + (x − y)/(K·lr)``, ``c ← c + Δc_i/N``."""
    steps, lr, n = 3, 0.5, 2
    raw = make_raw(data_files, tmp_path / "run", "scaffold", federation={"num_clients": n, "clients_per_round": 1},
                   train={"optimizer": "sgd", "local_steps": steps, "lr": lr, "batch_size": 24})
    result = run(parse_recipe(raw))

    fed = build_federation(parse_recipe(raw))  # a fresh copy of the same model and data
    model, keys = fed.loaded.model, fed.global_keys
    assert all(len(ix) == 24 for ix in fed.data.clients)  # batch = the client's whole data set
    params = dict(model.named_parameters())
    model.train()

    def gradient(cid, y):
        write_state(model, y)
        batch = collate([fed.data.examples[i] for i in fed.data.clients[cid]],
                        pad_id=fed.loaded.tokenizer.pad_token_id, task=fed.loaded.task)
        grads = torch.autograd.grad(model(**batch).loss, [params[k] for k in keys])
        return dict(zip(keys, grads, strict=True))

    x = read_state(model, keys)
    c = {k: torch.zeros_like(v) for k, v in x.items()}
    c_i = {cid: {k: torch.zeros_like(v) for k, v in x.items()} for cid in range(n)}
    corrections = []
    for h in result.history:
        (cid,) = h["clients"]
        corrections.append(max(float((c[k] - c_i[cid][k]).abs().max()) for k in keys))
        y = {k: v.clone() for k, v in x.items()}
        for _ in range(steps):
            g = gradient(cid, y)
            y = {k: y[k] - lr * (g[k] - c_i[cid][k] + c[k]) for k in keys}
        new = {k: c_i[cid][k] - c[k] + (x[k] - y[k]) / (steps * lr) for k in keys}
        delta = {k: new[k] - c_i[cid][k] for k in keys}
        c_i[cid] = new
        x = y  # one client: x ← x + (y − x)
        c = {k: c[k] + delta[k] / n for k in keys}  # c ← c + (|S|/N)·mean Δc_i

    assert corrections[0] == 0 and corrections[1] > 1e-3  # round 2 is corrected
    server_c = result.strategy.state_dict()
    for k in keys:
        torch.testing.assert_close(result.global_state[k], x[k], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(server_c[f"c/{k}"], c[k], rtol=1e-4, atol=1e-5)
    for cid in {h["clients"][0] for h in result.history}:
        stored = result.clients.get(cid)
        for k in keys:
            torch.testing.assert_close(stored[k], c_i[cid][k], rtol=1e-4, atol=1e-5)
    assert any(float(v.abs().max()) > 1e-3 for v in c.values())


def test_upload_carries_the_model_and_delta_c_and_bytes_count_both(data_files, tmp_path, monkeypatch):
    seen = record_updates(monkeypatch, Scaffold)
    result = run(parse_recipe(make_raw(data_files, tmp_path / "run", "scaffold")))
    keys = set(result.global_state)
    assert seen and all(set(u.state) == keys | {DELTA_C + k for k in keys} for u in seen)
    lora = sum(v.numel() * 4 for v in result.global_state.values())
    for h in result.history:  # y_i and Δc_i up; x and c down
        assert set(h["bytes_up"].values()) == {2 * lora} and set(h["bytes_down"].values()) == {2 * lora}
    # the stored c_i of a client is what it uploaded as Δc_i the first time it trained (c_i starts at 0)
    first = {}
    for u in seen:
        first.setdefault(u.client_id, u)
    once = [c for c in first if sum(c in h["clients"] for h in result.history) == 1]
    for cid in once:
        stored = result.clients.get(cid)
        assert all(torch.equal(stored[k], first[cid].state[DELTA_C + k]) for k in keys)


def test_lr_zero_keeps_the_variates(data_files, tmp_path):
    result = run(parse_recipe(make_raw(data_files, tmp_path / "run", "scaffold", train={"lr": 0.0})))
    assert all(float(v.abs().max()) == 0 for v in result.strategy.state_dict().values())


@pytest.mark.parametrize("comm", ["bf16"])
def test_the_server_variate_travels_in_the_wire_dtype(comm, data_files, tmp_path, monkeypatch):
    sent = []
    original = Scaffold.open_client

    def spy(self, plan):
        sent.append(plan.extra["c"])
        return original(self, plan)

    monkeypatch.setattr(Scaffold, "open_client", spy)
    run(parse_recipe(make_raw(data_files, tmp_path / "run", "scaffold", federation={"comm_dtype": comm})))
    last = sent[-1]
    assert any(float(v.abs().max()) > 0 for v in last.values())
    assert all(torch.equal(v, v.bfloat16().float()) for v in last.values())


def test_the_upload_layout_is_known_before_training(data_files, tmp_path):
    """The round loop checks every update against ``client_upload`` on meta tensors: SCAFFOLD's Δc included."""
    from fedllm.engine.client_faults import expected_upload

    fed = build_federation(parse_recipe(make_raw(data_files, tmp_path / "run", "scaffold")))
    state = read_state(fed.loaded.model, fed.global_keys)
    plan = fed.strategy.configure_client(1, 0, state)
    expected = expected_upload(fed.strategy, plan, fed.loaded.model)
    assert expected == {**{k: (tuple(v.shape), torch.float32) for k, v in state.items()},
                        **{DELTA_C + k: (tuple(v.shape), torch.float32) for k, v in state.items()}}


@pytest.mark.parametrize("weighting", ["uniform", "examples"])
def test_server_mean_follows_the_chosen_weighting(weighting, data_files, tmp_path, monkeypatch):
    """The paper's server step with η_g = 1: ``x ← x + (1/|S|)·Σ_S (y_i − x) = (1/|S|)·Σ_S y_i`` (``uniform``,
    issue #23.3); ``examples`` weights ``y_i`` by the clients' example counts (OpenFedLLM's aggregation, which
    the FRLoRA baselines use). ``c ← c + (1/N)·Σ_S Δc_i`` either way. Computed by hand from the uploads."""
    seen = record_updates(monkeypatch, Scaffold)
    raw = make_raw(data_files, tmp_path / "run", "scaffold", {"weighting": weighting}, federation={"rounds": 1},
                   data={"path": str(data_files["arith"]), "format": "instruction", "max_examples": 40,
                         "fields": {"instruction": "question", "output": "answer"}})
    result = run(parse_recipe(raw))
    assert len(seen) == 2 and seen[0].num_examples != seen[1].num_examples  # the weightings differ here
    keys = list(result.global_state)
    n = [u.num_examples for u in seen]
    p = [0.5, 0.5] if weighting == "uniform" else [n[0] / sum(n), n[1] / sum(n)]
    for k in keys:
        expected = p[0] * seen[0].state[k].double() + p[1] * seen[1].state[k].double()
        torch.testing.assert_close(result.global_state[k].double(), expected, rtol=0, atol=1e-6)
    c = result.strategy.c
    for k in keys:
        expected = (seen[0].state[DELTA_C + k] + seen[1].state[DELTA_C + k]) / 3  # N = 3 clients
        torch.testing.assert_close(c[k], expected, rtol=0, atol=1e-6)
