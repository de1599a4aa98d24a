"""Fed-SB: W + s·B·R·A with B, A fixed (LoRA-SB's init) and only R trained, sent and averaged (exactly)."""

import json

import pytest
import torch
from strategy_helpers import assert_dp_sgd_epsilon_per_client, effective_weights, make_raw, record_rounds, tiny

from fedllm.common.errors import InputError
from fedllm.engine import server
from fedllm.engine.server import build_federation, run
from fedllm.models.loading import read_state
from fedllm.privacy import accounting
from fedllm.recipe.checks import parse_recipe
from fedllm.strategies.fed_sb import FedSB

R, ALPHA = 4, 8
S = ALPHA / R


def recorded(monkeypatch) -> list:
    """Every ``(rnd, global_state before, updates, global_state after)`` Fed-SB's aggregate sees."""
    return record_rounds(monkeypatch, FedSB)


def layer_keys(state):
    """``(b_key, r_key, a_key)`` of every LoRA layer in ``state``."""
    return [(k.replace(".lora_A.", ".lora_B."), k.replace(".lora_A.default.", ".fed_sb."), k)
            for k in state if ".lora_A." in k]


def test_fed_sb_replay_of_a_round_from_the_recorded_uploads(data_files, tmp_path, monkeypatch):
    """R̄ = (1/c)·Σ_k R_k from the uploads (the paper's uniform mean, on clients of unequal sizes); the model then
    computes W + s·B·R̄·A, which is exactly the mean of the clients' own W + s·B·R_k·A; A and B never move."""
    rounds = recorded(monkeypatch)
    skewed = {"method": "dirichlet", "column": "category", "beta": 1.0, "min_size": 4}  # unequal client sizes
    result = run(parse_recipe(make_raw(data_files, tmp_path / "run", "fed_sb",
                                       federation={"rounds": 2, "partition": skewed})))
    keys = layer_keys(result.global_state)
    assert keys and [r[0] for r in rounds] == [1, 2]
    for rnd, before, updates, out in rounds:
        assert len(updates) == 2 and len({u.num_examples for u in updates}) == 2  # uniform ≠ example-weighted
        for b_key, r_key, a_key in keys:
            assert all(set(u.state) == {k for _, k, _ in keys} for u in updates)  # R only travels up
            r_bar = sum(u.state[r_key].double() for u in updates) / len(updates)
            assert (out[r_key].double() - r_bar).abs().max() <= 1e-6, (rnd, r_key)
            assert torch.equal(out[b_key], before[b_key]) and torch.equal(out[a_key], before[a_key])
            b, a = before[b_key].double(), before[a_key].double()
            mean_update = sum(S * b @ u.state[r_key].double() @ a for u in updates) / len(updates)
            assert (S * b @ out[r_key].double() @ a - mean_update).abs().max() <= 1e-6  # exact aggregation
    # the model holds it: each layer computes W + s·B·R̄·A
    base = effective_weights(tiny().model)  # B = 0 at PEFT's init: the pretrained weights
    got = effective_weights(result.model)
    final = result.global_state
    for b_key, r_key, a_key in keys:
        name = a_key.split(".lora_A.")[0]
        want = base[name].double() + S * final[b_key].double() @ final[r_key].double() @ final[a_key].double()
        assert (got[name].double() - want).abs().max() <= 1e-6, name


def test_fed_sb_gradient_init_is_the_svd_of_the_sign_of_the_full_gradient(data_files, tmp_path):
    """Independently of fedllm's loss code: plain transformers' loss of every example (batch size 1, so the sum
    does not depend on how examples are grouped), its gradient with respect to each wrapped pretrained weight,
    ΔW = −η·sign(Σ ∇W), and the exact rank-r SVD of ΔW in fp64: the model starts at W + s·ΔW_r."""
    lr = 1e-3
    raw = make_raw(data_files, tmp_path / "run", "fed_sb", {"svd": "exact", "init_samples": 1000, "init_lr": lr},
                   train={"batch_size": 1})
    fed = build_federation(parse_recipe(raw))
    plain = tiny().model.merge_and_unload()  # B = 0: the pretrained model, no PEFT, no hooks
    plain.eval()
    names = list(fed.strategy.layers)
    weights = {n: plain.get_submodule(n.removeprefix("base_model.model.")).weight for n in names}
    for w in weights.values():
        w.requires_grad_(True)
    examples, collate, _ = fed.strategy.training_data
    assert len(examples) < 1000  # every example is read
    for example in examples:
        batch = collate([example])
        plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss.backward()
    got = effective_weights(fed.loaded.model)
    for n in names:
        delta = -lr * torch.sign(weights[n].grad.double())
        u, s, vh = torch.linalg.svd(delta, full_matrices=False)
        want = weights[n].detach().double() + S * (u[:, :R] * s[:R]) @ vh[:R]
        assert (got[n].double() - want).abs().max() <= 1e-6, n
        layer = fed.strategy.layers[n]
        b, a = layer.module.lora_B["default"].weight.double(), layer.module.lora_A["default"].weight.double()
        eye = torch.eye(R, dtype=torch.float64)
        assert (b.T @ b - eye).abs().max() <= 1e-5 and (a @ a.T - eye).abs().max() <= 1e-5  # fp32 U_r, Vh_r
        latent = fed.strategy.latents[n].weight.double()
        assert torch.allclose(latent, torch.diag(s[:R]), atol=1e-6, rtol=1e-6)  # R = diag(S_r)


def test_fed_sb_sends_a_and_b_once_per_client_then_r_only(data_files, tmp_path):
    raw = make_raw(data_files, tmp_path / "run", "fed_sb", {"init": "weights"}, federation={"rounds": 3})
    result = run(parse_recipe(raw))
    state = result.global_state
    r_bytes = sum(4 * v.numel() for k, v in state.items() if ".fed_sb." in k)
    all_bytes = sum(4 * v.numel() for v in state.values())
    assert r_bytes == 4 * R * R * len(layer_keys(state)) and all_bytes > 10 * r_bytes
    seen: set = set()
    for h in result.history:
        assert set(h["bytes_up"].values()) == {r_bytes}
        for c in h["clients"]:
            assert h["bytes_down"][str(c)] == (r_bytes if c in seen else all_bytes), (h["round"], c)
        seen |= set(h["clients"])
    assert result.strategy.has_factors.tolist() == [int(c in seen) for c in range(3)]


@pytest.mark.parametrize("args,sections,message", [
    ({"init": "svd"}, {}, "strategy_args.init: got 'svd'"),
    ({"init_samples": 0}, {}, "strategy_args.init_samples: got 0"),
    ({"svd": "fast"}, {}, "strategy_args.svd: got 'fast'"),
    ({"init_lr": -1.0}, {}, "strategy_args.init_lr: got -1.0"),
    ({"warmup_ratio": 0}, {}, "strategy_args.warmup_ratio: got 0"),
    ({}, {"privacy": {"mechanism": "dp_sgd", "noise_multiplier": 1.0}}, "strategy_args.init: got 'gradient'"),
])
def test_fed_sb_bad_arguments_are_refused_at_load(args, sections, message, data_files, tmp_path):
    with pytest.raises(InputError, match=message):
        parse_recipe(make_raw(data_files, tmp_path / "run", "fed_sb", args, **sections))


def test_fed_sb_under_dp_sgd_noises_r_only_and_accounts_epsilon(data_files, tmp_path, monkeypatch):
    """DP-SGD (Fed-SB's private setting): opacus clips and noises the per-example gradients of R (an nn.Linear
    applied by the hook); A and B stay bit-identical on every client; each client's ε is the accountant's."""
    rounds = recorded(monkeypatch)
    fixed = []
    original_run = server.run_client

    def run_spy(model, plan, *args, **kwargs):
        update = original_run(model, plan, *args, **kwargs)
        keys = [k for k in {**plan.state, **plan.local} if ".lora_" in k]
        held = {**plan.state, **plan.local}
        fixed.append(len(keys) > 0 and all(torch.equal(v, held[k]) for k, v in read_state(model, keys).items()))
        return update

    monkeypatch.setattr(server, "run_client", run_spy)
    privacy = {"mechanism": "dp_sgd", "noise_multiplier": 1.0, "clipping_norm": 0.5, "delta": 1e-3, "noise_seed": 2}
    raw = make_raw(data_files, tmp_path / "run", "fed_sb", {"init": "weights"}, privacy=privacy,
                   federation={"rounds": 2})
    result = run(parse_recipe(raw))
    assert_dp_sgd_epsilon_per_client(result, noise_multiplier=1.0, batch_size=4, delta=1e-3)
    assert len(fixed) == 4 and all(fixed)
    (_, before, updates, out), _ = rounds
    r_keys = [k for k in before if ".fed_sb." in k]
    assert all(set(u.state) == set(r_keys) and u.loss is None for u in updates)
    assert all(not torch.equal(out[k], before[k]) for k in r_keys)  # R trained (noisily)


def test_fed_sb_under_client_level_dp_clips_and_noises_r_only(data_files, tmp_path, monkeypatch):
    """Client-level DP (clients clip, the server noises the sum): each upload is R only and its change is within
    the clipping norm; the released R̄ is the mean of the clipped uploads plus N(0, (zC/m)²) noise per coordinate;
    A and B are never noised; ε is the accountant's for the rounds released."""
    rounds = recorded(monkeypatch)
    uploads: dict = {}
    original_run = server.run_client

    def run_spy(model, plan, *args, **kwargs):
        update = original_run(model, plan, *args, **kwargs)
        uploads[(plan.rnd, plan.client_id)] = ({k: v.clone() for k, v in update.state.items()}, plan.state)
        return update

    monkeypatch.setattr(server, "run_client", run_spy)
    z, norm, m = 0.5, 0.01, 2
    privacy = {"mechanism": "central_client_clipping", "noise_multiplier": z, "clipping_norm": norm, "noise_seed": 3,
               "delta": 1e-3}
    raw = make_raw(data_files, tmp_path / "run", "fed_sb", {"init": "weights"}, privacy=privacy)
    result = run(parse_recipe(raw))
    assert len(uploads) == 4
    for up, sent in uploads.values():
        assert set(up) == {k for k in sent if ".fed_sb." in k}
        change = sum(float((up[k].double() - sent[k].double()).pow(2).sum()) for k in up) ** 0.5
        assert norm / 2 < change <= norm * (1 + 1e-5)  # clipped (the raw change is larger)
    lines = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    mode = accounting.resolved("auto", 3, m)
    for rnd, line in enumerate(lines, start=1):
        assert line["epsilon"] == pytest.approx(accounting.central_epsilon(mode, z, 3, m, rnd, 1e-3), rel=1e-9)
    for rnd, before, updates, out in rounds:
        assert all(torch.equal(out[k], before[k]) for k in before if ".lora_" in k)  # A, B: never noised
        clipped = [uploads[(rnd, u.client_id)][0] for u in updates]
        noise = torch.cat([(out[k].double() - sum(c[k].double() for c in clipped) / m).flatten() for k in clipped[0]])
        assert 0.7 < float(noise.std()) / (z * norm / m) < 1.3, rnd  # the Gaussian mechanism's std zC/m


def test_fed_sb_default_init_step_is_the_first_warmup_step_of_the_run():
    """η = lr / (warmup_ratio · T), T = a client's steps over the run (the authors' eff_lr), at most train.lr."""
    strategy = FedSB(warmup_ratio=0.02)
    strategy.recipe = parse_recipe({"data": {"path": "unused.jsonl"}, "train": {"local_steps": 50, "lr": 1e-3},
                                    "federation": {"num_clients": 3, "rounds": 20}})
    assert strategy.default_init_lr(100) == pytest.approx(1e-3 / (0.02 * 50 * 20))
    strategy.recipe.federation.rounds = 1
    strategy.recipe.train.local_steps = 10
    assert strategy.default_init_lr(100) == 1e-3  # fewer than 1 / warmup_ratio steps: one warmup step


def test_fed_sb_adapter_export_is_exact_at_rank_2r_and_at_rank_r(data_files, tmp_path):
    """B·R·A has rank r: the plain PEFT adapter stacks (B, B·R − B) at rank 2r, and `--rank r` gives an exact rank-r
    adapter too (its SVD loses nothing); both reproduce the run's logits (the reloads in plain transformers / peft
    are in tests/export)."""
    from fedllm.export.api import export

    result = run(parse_recipe(make_raw(data_files, tmp_path / "run", "fed_sb")))
    for rank, want in ((None, 2 * R), (R, R)):
        out = tmp_path / f"adapter-{rank}"
        export(result.run_dir, "adapter", out, rank=rank)
        report = json.loads((out / "export.json").read_text())
        assert report["exact"] and not report["truncated_layers"] and report["rel_error_max"] < 1e-6
        assert report["max_logit_diff"] < 1e-5
        assert json.loads((out / "adapter_config.json").read_text())["r"] == want


def test_fed_sb_weights_init_is_lora_xs_from_the_pretrained_svd(data_files, tmp_path):
    """init: weights (the authors' data-free find_and_initialize): B = U_r and A = diag(S_r)·Vh_r of the pretrained
    weight (compared through B·A against an fp64 SVD), R ~ N(0, 1e-5²)."""
    raw = make_raw(data_files, tmp_path / "run", "fed_sb", {"init": "weights", "svd": "exact"})
    fed = build_federation(parse_recipe(raw))
    latents = []
    for layer in fed.strategy.layers.values():
        u, s, vh = torch.linalg.svd(layer.base.weight.detach().double(), full_matrices=False)
        b, a = layer.module.lora_B["default"].weight.double(), layer.module.lora_A["default"].weight.double()
        # B·A is the best rank-r approximation U_r·diag(S_r)·Vh_r, with B's columns orthonormal (B = U_r)
        assert (b @ a - (u[:, :R] * s[:R]) @ vh[:R]).abs().max() <= 1e-5 * float(s[0])
        assert (b.T @ b - torch.eye(R, dtype=torch.float64)).abs().max() <= 1e-5
        latents.append(fed.strategy.latents[layer.name].weight.detach().flatten())
    drawn = torch.cat(latents)
    assert abs(float(drawn.std()) / 1e-5 - 1) < 0.3 and float(drawn.abs().max()) < 1e-4
