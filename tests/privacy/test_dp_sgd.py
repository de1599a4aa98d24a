"""DP-SGD on the clients (privacy.mechanism: dp_sgd): opacus's clipped per-example gradients (hooks and ghost
clipping) against per-example backward passes and against each other, per-client ε in a run on the causal-LM and
classifier presets, and the refusal of layers opacus cannot handle."""

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from fedllm.common.errors import InputError
from fedllm.data.collate import collate
from fedllm.engine.server import build_federation, run
from fedllm.privacy import accounting, with_privacy
from fedllm.privacy.dp_sgd import LocalDPSGD, ghost_fallback_layers, per_example_losses
from fedllm.privacy.secret_streams import secret_of_seed
from fedllm.recipe.checks import parse_recipe
from fedllm.strategies import ClientInfo, get_strategy

DP_SGD = {"mechanism": "dp_sgd", "noise_multiplier": 1.1, "clipping_norm": 0.5, "delta": 1e-3, "noise_seed": 0}


MODES = ["hooks", "ghost"]
PRESETS = pytest.mark.parametrize("classification", [False, True], ids=["causal-lm", "classifier"])


def tiny_model(classification, tiny_recipe, tmp_path):
    """``(federation, its model without dropout, trainable tensors)`` of the causal-LM or classifier preset."""
    raw = tiny_recipe(privacy=DP_SGD)
    if classification:
        (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": f"t {i} {'ab'[i % 2]}", "label": "ab"[i % 2]})
                                                  + "\n" for i in range(24)))
        raw = tiny_recipe(privacy=DP_SGD, model={"name": "tiny-roberta"},
                          data={"path": str(tmp_path / "c.jsonl"), "format": "classification"})
    fed = build_federation(parse_recipe(raw))
    model = fed.loaded.model
    for module in model.modules():  # no dropout: the per-example passes must see the same network
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return fed, model, [p for p in model.parameters() if p.requires_grad]


def restore(params, values):
    with torch.no_grad():
        for p, v in zip(params, values, strict=True):
            p.copy_(v)


def one_step(fed, model, params, start, mode, noise_multiplier, seed=3, empty=False):
    """Trainable tensors after one DP-SGD step with SGD (lr 1) from ``start`` on client 0's Poisson batch of
    ``seed`` (the same batch and noise for every mode), and the examples it drew."""
    restore(params, start)
    indices = fed.data.clients[0]
    dp = LocalDPSGD(noise_multiplier, clipping_norm=0.5, batch_size=4, num_examples=len(indices),
                    secret=secret_of_seed(seed), grad_sample_mode=mode)
    drawn = dp.stream(indices).next()
    assert drawn
    batch = collate([fed.data.examples[i] for i in drawn], fed.loaded.tokenizer.pad_token_id, fed.loaded.task)
    with dp.phase(model, torch.optim.SGD(params, lr=1.0)) as stepper:
        stepper.zero_grad(set_to_none=True)
        if empty:
            dp.empty_batch(params)
        else:
            total, _ = dp.loss(model, batch)
            total.backward()
            materialized = [p.grad_sample is not None for p in params]
            assert any(materialized) if mode == "hooks" else not any(materialized)  # ghost: norms only
        stepper.step()
    assert all(getattr(p, "grad_sample", None) is None for p in params)  # hooks removed after the phase
    return [p.detach().clone() for p in params], batch


@PRESETS
@pytest.mark.parametrize("mode", MODES)
def test_one_step_is_the_mean_of_clipped_per_example_gradients(classification, mode, tiny_recipe, tmp_path):
    fed, model, params = tiny_model(classification, tiny_recipe, tmp_path)
    start = [p.detach().clone() for p in params]
    after, batch = one_step(fed, model, params, start, mode, noise_multiplier=0.0)
    restore(params, start)
    expected = [torch.zeros_like(p) for p in params]
    norms = []
    for i in range(len(batch["labels"])):  # independent: one backward per example, clipped by hand
        model.zero_grad()
        per_example_losses(model, {k: v[i:i + 1] for k, v in batch.items()}).sum().backward()
        grads = [p.grad.detach().clone() for p in params]
        norms.append(float(torch.sqrt(sum(g.square().sum() for g in grads))))
        for e, g in zip(expected, grads, strict=True):
            e += g * min(1.0, 0.5 / norms[-1])
    assert len(norms) > 1 and max(norms) > 0.5  # a batch of several examples, and clipping binds
    for p, p0, e in zip(after, start, expected, strict=True):  # p = p0 − lr·Σ clip(g_i) / expected batch size
        torch.testing.assert_close(p, p0 - e / 4, atol=1e-5, rtol=1e-4)


@PRESETS
def test_ghost_clipping_takes_the_same_noised_step_as_hooks(classification, tiny_recipe, tmp_path):
    """Same Poisson batch, same noise seed: ghost clipping's step equals hooks' to float rounding (atol 1e-6,
    rtol 1e-5), noisy and noise-only (an empty batch); every trainable layer of the preset has a ghost norm."""
    fed, model, params = tiny_model(classification, tiny_recipe, tmp_path)
    assert ghost_fallback_layers(model) == []
    start = [p.detach().clone() for p in params]
    clean, _ = one_step(fed, model, params, start, "hooks", noise_multiplier=0.0)
    for empty in (False, True):
        hooks, _ = one_step(fed, model, params, start, "hooks", noise_multiplier=1.1, empty=empty)
        ghost, _ = one_step(fed, model, params, start, "ghost", noise_multiplier=1.1, empty=empty)
        for h, g in zip(hooks, ghost, strict=True):
            torch.testing.assert_close(g, h, atol=1e-6, rtol=1e-5)
        noise = torch.cat([(h - c).flatten() for h, c in zip(hooks, clean, strict=True)])
        assert float(noise.norm()) > 0.1  # the noise (std 1.1·0.5/4 per coordinate) is in both


def test_a_run_reports_each_clients_epsilon_and_a_ghost_run_equals_a_hooks_run(tiny_recipe, tmp_path):
    """Per-client ε every round as the accountant gives it for the steps each client took (hooks); the same recipe
    and noise seed with ghost clipping: the same ε and steps every round (exactly) and the same trained adapters
    (atol 1e-5 after 2 rounds of 2 noisy steps)."""
    results = {}
    for mode in MODES:
        raw = tiny_recipe(privacy={**DP_SGD, "noise_multiplier": None, "target_epsilon": 4.0, "grad_sample_mode": mode},
                          output_dir=str(tmp_path / mode), federation={"rounds": 2, "clients_per_round": 2},
                          train={"local_steps": 2, "batch_size": 4})
        result = run(parse_recipe(raw))
        results[mode] = (result, [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()])
    (hooks, lines), (ghost, ghost_lines) = results["hooks"], results["ghost"]
    z = lines[0]["privacy"]["noise_multiplier"]
    steps: dict[str, int] = {}
    for line in lines:
        for cid, s in line["client_steps"].items():
            steps[cid] = steps.get(cid, 0) + s
        sizes = hooks.strategy.sizes
        want = {cid: accounting.dp_sgd_epsilon(z, 4 / sizes[int(cid)], s, 1e-3) for cid, s in steps.items()}
        assert line["client_epsilon"] == pytest.approx(want, rel=1e-9)
        assert line["epsilon"] == max(want.values())
    assert lines[-1]["epsilon"] <= 4.0  # target_epsilon holds for a client trained every round
    trained_b = [v for k, v in hooks.global_state.items() if "lora_B" in k]  # B starts at zero
    assert trained_b and all(float(v.abs().max()) > 0 for v in trained_b)
    for h, g in zip(lines, ghost_lines, strict=True):
        assert g["client_epsilon"] == h["client_epsilon"] and g["epsilon"] == h["epsilon"] > 0
        assert g["client_steps"] == h["client_steps"]
        assert (h["privacy"]["grad_sample_mode"], g["privacy"]["grad_sample_mode"]) == ("hooks", "ghost")
    assert hooks.global_state.keys() == ghost.global_state.keys()
    for key in hooks.global_state:
        torch.testing.assert_close(ghost.global_state[key], hooks.global_state[key], atol=1e-5, rtol=1e-4)


def test_layers_opacus_cannot_handle_are_refused_with_the_key():
    recipe = parse_recipe({"data": {"path": "unused.jsonl"}, "train": {"local_steps": 1},
                           "federation": {"num_clients": 2}, "privacy": DP_SGD}, source="r.yaml")
    strategy = with_privacy(get_strategy("fedavg"), recipe)
    strategy.recipe = recipe
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    with pytest.raises(InputError, match="r.yaml: privacy.mechanism.*BatchNorm1d"):
        strategy.setup(model, [ClientInfo(0, 10), ClientInfo(1, 10)])


def test_ghost_clipping_names_the_layers_that_fall_back_to_per_example_gradients(caplog):
    """opacus has ghost norms for Linear and Embedding only; a trainable LayerNorm builds per-example gradients
    (its fast gradient clipping), and setup says so by name."""
    recipe = parse_recipe({"data": {"path": "unused.jsonl"}, "train": {"local_steps": 1},
                           "federation": {"num_clients": 2}, "privacy": {**DP_SGD, "grad_sample_mode": "ghost"}})
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    assert ghost_fallback_layers(model) == ["2 (LayerNorm)"]
    strategy = with_privacy(get_strategy("fedavg"), recipe)
    strategy.recipe = recipe
    with caplog.at_level(logging.WARNING, logger="fedllm"):
        strategy.setup(model, [ClientInfo(0, 10), ClientInfo(1, 10)])
    assert "no ghost norm for 1 trainable layer(s)" in caplog.text and "2 (LayerNorm)" in caplog.text


def test_ghost_clipping_refuses_a_layer_called_twice_in_one_pass_with_the_key():
    """opacus's ghost clipping cannot take a norm for tied parameters (a layer used twice in one forward pass):
    the loss is refused with an InputError naming privacy.grad_sample_mode, not a bare NotImplementedError."""

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.lin = torch.nn.Embedding(5, 3), torch.nn.Linear(3, 3)

        def forward(self, input_ids, attention_mask=None):
            return SimpleNamespace(logits=self.lin(self.lin(self.emb(input_ids).mean(1))))

    model = Twice()
    dp = LocalDPSGD(noise_multiplier=1.0, clipping_norm=1.0, batch_size=2, num_examples=4, secret=secret_of_seed(0),
                    grad_sample_mode="ghost")
    batch = {"input_ids": torch.tensor([[1, 2], [3, 4]]), "labels": torch.tensor([0, 1])}
    with dp.phase(model, torch.optim.SGD(model.parameters(), lr=0.1)):
        with pytest.raises(InputError, match="privacy.grad_sample_mode: got 'ghost'; expected hooks.*tying"):
            dp.loss(model, batch)
