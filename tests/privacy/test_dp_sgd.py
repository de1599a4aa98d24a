"""DP-SGD on the clients (privacy.mechanism: dp_sgd): opacus's clipped per-example gradients against per-example
backward passes, per-client ε in a run on the causal-LM and classifier presets, and the refusal of layers opacus
cannot handle."""

import json

import pytest
import torch

from fedllm.config import parse_recipe
from fedllm.data import collate
from fedllm.errors import InputError
from fedllm.privacy import accounting, with_privacy
from fedllm.privacy.dp_sgd import LocalDPSGD, per_example_losses
from fedllm.server import build_federation, run
from fedllm.strategies import ClientInfo, get_strategy

DP_SGD = {"mechanism": "dp_sgd", "noise_multiplier": 1.1, "clipping_norm": 0.5, "delta": 1e-3, "noise_seed": 0}


@pytest.mark.parametrize("classification", [False, True], ids=["causal-lm", "classifier"])
def test_one_step_is_the_mean_of_clipped_per_example_gradients(classification, tiny_recipe, tmp_path):
    raw = tiny_recipe(privacy=DP_SGD)
    if classification:
        (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": f"t {i} {'ab'[i % 2]}", "label": "ab"[i % 2]})
                                                  + "\n" for i in range(24)))
        raw = tiny_recipe(privacy=DP_SGD, model={"name": "tiny-roberta"},
                          data={"path": str(tmp_path / "c.jsonl"), "format": "classification"})
    fed = build_federation(parse_recipe(raw))
    model, task = fed.loaded.model, fed.loaded.task
    for module in model.modules():  # no dropout: the per-example passes must see the same network
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    examples = [fed.data.examples[i] for i in fed.data.clients[0][:5]]
    batch = collate(examples, fed.loaded.tokenizer.pad_token_id, task)
    params = [p for p in model.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params]
    expected = [torch.zeros_like(p) for p in params]
    for i in range(len(examples)):  # independent: one backward per example, clipped by hand
        model.zero_grad()
        per_example_losses(model, {k: v[i:i + 1] for k, v in batch.items()}).sum().backward()
        grads = [p.grad.detach().clone() for p in params]
        norm = torch.sqrt(sum(g.square().sum() for g in grads))
        for e, g in zip(expected, grads, strict=True):
            e += g * min(1.0, 0.5 / float(norm))
    model.zero_grad()
    dp = LocalDPSGD(noise_multiplier=0.0, clipping_norm=0.5, batch_size=4, num_examples=20, seed=0)
    sgd = torch.optim.SGD(params, lr=1.0)
    with dp.phase(model, sgd) as stepper:
        total, _ = dp.loss(model, batch)
        total.backward()
        stepper.step()
    for p, p0, e in zip(params, start, expected, strict=True):  # p = p0 − lr·Σ clip(g_i) / expected batch size
        torch.testing.assert_close(p.detach(), p0 - e / 4, atol=1e-5, rtol=1e-4)
    assert not hasattr(params[0], "grad_sample") or params[0].grad_sample is None  # hooks removed after the phase


def test_a_run_reports_each_clients_epsilon(tiny_recipe):
    raw = tiny_recipe(privacy={**DP_SGD, "noise_multiplier": None, "target_epsilon": 4.0},
                      federation={"rounds": 2, "clients_per_round": 2}, train={"local_steps": 2, "batch_size": 4})
    result = run(parse_recipe(raw))
    lines = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    z = lines[0]["privacy"]["noise_multiplier"]
    steps: dict[str, int] = {}
    for line in lines:
        for cid, s in line["client_steps"].items():
            steps[cid] = steps.get(cid, 0) + s
        sizes = result.strategy.sizes
        want = {cid: accounting.dp_sgd_epsilon(z, 4 / sizes[int(cid)], s, 1e-3) for cid, s in steps.items()}
        assert line["client_epsilon"] == pytest.approx(want, rel=1e-9)
        assert line["epsilon"] == max(want.values())
    assert lines[-1]["epsilon"] <= 4.0  # target_epsilon holds for a client trained every round
    trained_b = [v for k, v in result.global_state.items() if "lora_B" in k]  # B starts at zero
    assert trained_b and all(float(v.abs().max()) > 0 for v in trained_b)


def test_layers_opacus_cannot_handle_are_refused_with_the_key():
    recipe = parse_recipe({"data": {"path": "unused.jsonl"}, "train": {"local_steps": 1},
                           "federation": {"num_clients": 2}, "privacy": DP_SGD}, source="r.yaml")
    strategy = with_privacy(get_strategy("fedavg"), recipe)
    strategy.recipe = recipe
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    with pytest.raises(InputError, match="r.yaml: privacy.mechanism.*BatchNorm1d"):
        strategy.setup(model, [ClientInfo(0, 10), ClientInfo(1, 10)])
