"""DP-SGD with a pairwise loss (``privacy.mechanism: dp_sgd`` + ``train.objective: dpo``): a preference pair is
one example. One step against per-pair clipping by hand (each pair's gradient from its own backward pass of its
own loss, clipped to C, summed, plus the same noise draw, over the expected number of pairs), and a run whose
accountant counts pairs."""

import json
import math
from functools import partial

import pytest
import torch

from fedllm.data.collate import collate
from fedllm.engine.reference import compute_reference, with_reference
from fedllm.engine.server import build_federation, run
from fedllm.models.preference_loss import pair_losses
from fedllm.privacy import accounting, dp_sgd
from fedllm.privacy.dp_sgd import LocalDPSGD
from fedllm.privacy.secret_streams import secret_of_seed
from fedllm.recipe.checks import parse_recipe
from tests.conftest import tiny_raw
from tests.preference_helpers import preference_records

C, EXPECTED_PAIRS = 1.3, 4
DP_SGD = {"mechanism": "dp_sgd", "noise_multiplier": 1.1, "clipping_norm": C, "delta": 1e-3, "noise_seed": 0}


def write_pairs(path, n):
    path.write_text("".join(json.dumps(r) + "\n" for r in preference_records(n)))
    return path


def dpo_dp_raw(tmp_path, **sections):
    own = {"data": {"path": str(write_pairs(tmp_path / "pairs.jsonl", 36)), "format": "preference", "fields": {}},
           "train": {"objective": "dpo", "max_length": 48, "lr": 5e-2, "batch_size": EXPECTED_PAIRS,
                     "preference": {"beta": 0.5}},
           "privacy": DP_SGD}
    for key, value in sections.items():
        own[key] = {**own.get(key, {}), **value}
    return tiny_raw(tmp_path / "run", tmp_path / "pairs.jsonl", **own)


@pytest.fixture
def pair_federation(tmp_path):
    """A DPO federation in float64 without dropout, its LoRA B factors moved off zero (so Δ ≠ 0 and every factor
    has a gradient), and client 0's pairs carrying the reference log-probabilities of the starting model."""
    fed = build_federation(parse_recipe(dpo_dp_raw(tmp_path)))
    model = fed.loaded.model.double()
    for module in model.modules():  # the hand-made passes must see the same network
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    batches = partial(collate, pad_id=fed.loaded.tokenizer.pad_token_id)
    indices = fed.data.clients[0]
    table = compute_reference(model, fed.data.examples, indices, fed.recipe.train, batches)
    examples = with_reference(fed.data.examples, indices, {"reference/logps": table})
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    params = [p for p in model.parameters() if p.requires_grad]
    return fed, model, params, examples, indices, batches


def restore(params, values):
    with torch.no_grad():
        for p, v in zip(params, values, strict=True):
            p.copy_(v)


def one_step(fed, model, params, start, examples, indices, batches, empty=False, rows_per_pair=1):
    """Trainable tensors after one DP-SGD step (SGD, lr 1) from ``start`` on client 0's Poisson batch of pairs
    (seed 0: the same pairs and noise every call; its draw holds pairs on both sides of C, seed 3's did under the
    Mersenne Twister stream, not under the ChaCha20 one), and the pairs drawn."""
    restore(params, start)
    dp = LocalDPSGD(1.1, clipping_norm=C, batch_size=EXPECTED_PAIRS, num_examples=len(indices),
                    secret=secret_of_seed(0), preference=fed.recipe.train.preference)
    drawn = dp.stream(indices).next()
    with dp.phase(model, torch.optim.SGD(params, lr=1.0)) as stepper:
        stepper.zero_grad(set_to_none=True)
        if empty:
            dp.empty_batch(params)
        else:
            total, _ = dp.loss(model, batches([examples[i] for i in drawn]))
            (total / 1).backward()
            assert all(p.grad_sample.shape[0] == rows_per_pair * len(drawn) for p in params)  # one per pair
        stepper.step()
    return [p.detach().clone() for p in params], drawn


def test_preference_dp_sgd_step_clips_each_pairs_gradient(pair_federation, monkeypatch):
    fed, model, params, examples, indices, batches = pair_federation
    start = [p.detach().clone() for p in params]
    after, drawn = one_step(fed, model, params, start, examples, indices, batches)
    noise_only, _ = one_step(fed, model, params, start, examples, indices, batches, empty=True)
    restore(params, start)
    clipped = [torch.zeros_like(p) for p in params]
    norms = []
    for i in drawn:  # each pair alone: its own batch, its own backward pass of its own loss, clipped by hand
        model.zero_grad()
        losses, _, _ = pair_losses(model, batches([examples[i]]), fed.recipe.train.preference)
        losses.sum().backward()
        grads = [p.grad.detach().clone() for p in params]
        norms.append(float(torch.sqrt(sum(g.square().sum() for g in grads))))
        for c, g in zip(clipped, grads, strict=True):
            c += g * min(1.0, C / norms[-1])
    assert len(drawn) > 1 and max(norms) > C > min(norms)  # several pairs; clipping binds on some, not all
    # p = p0 − (Σ clip(g_pair) + noise) / E[pairs] (opacus clips by C / (norm + 1e-6): 6e-8 off here, in float64)
    for p, q, c in zip(after, noise_only, clipped, strict=True):
        torch.testing.assert_close(p, q - c / EXPECTED_PAIRS, atol=1e-6, rtol=0)
    noise = torch.cat([(q - p0).flatten() for q, p0 in zip(noise_only, start, strict=True)])
    assert float(noise.std()) == pytest.approx(1.1 * C / EXPECTED_PAIRS, rel=0.1)  # the noise draw is in the step

    monkeypatch.setattr(dp_sgd, "fold_pair_rows", lambda params, pairs: None)  # opacus alone: each sequence clipped
    per_sequence, _ = one_step(fed, model, params, start, examples, indices, batches, rows_per_pair=2)
    assert max(float((a - b).abs().max()) for a, b in zip(per_sequence, after, strict=True)) > 1e-3


def test_preference_dp_sgd_run_accounts_pairs(tmp_path):
    """A DPO run under DP-SGD: each client's ε is the accountant's for its steps at q = batch size / its pairs,
    and the adapter trains."""
    raw = dpo_dp_raw(tmp_path, federation={"rounds": 2, "clients_per_round": 2}, train={"local_steps": 2})
    result = run(parse_recipe(raw))
    lines = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    pairs = [12, 12, 12]  # 36 pairs over 3 iid clients: a pair is one example (not its 2 sequences)
    assert result.strategy.sizes == pairs
    steps: dict[str, int] = {}
    for line in lines:
        for cid, s in line["client_steps"].items():
            steps[cid] = steps.get(cid, 0) + s
        want = {cid: accounting.dp_sgd_epsilon(1.1, EXPECTED_PAIRS / pairs[int(cid)], s, 1e-3)
                for cid, s in steps.items()}
        assert line["client_epsilon"] == pytest.approx(want, rel=1e-9) and line["epsilon"] == max(want.values())
    assert sum(steps.values()) == 2 * 2 * 2
    trained_b = [v for k, v in result.global_state.items() if "lora_B" in k]
    assert trained_b and all(math.isfinite(float(v.abs().max())) and float(v.abs().max()) > 0 for v in trained_b)
