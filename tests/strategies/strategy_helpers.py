"""Helpers of the strategy tests: tiny models, fixture data, weights read through the model, fake rounds."""

import random

import torch

from fedllm.models.loading import load_model, lora_layers, write_state
from fedllm.recipe.checks import parse_recipe
from fedllm.recipe.schema import LoraConfig, ModelConfig
from fedllm.runs.client_store import ClientStore
from fedllm.strategies import ClientInfo, ClientUpdate, get_strategy
from tests.conftest import arith_records, tiny_raw, write_jsonl  # noqa: F401 (re-exported)

SENTIMENT = [("the movie was wonderful", "positive"), ("a dull and boring film", "negative"),
             ("i loved every minute", "positive"), ("the plot made no sense", "negative"),
             ("great acting and a good story", "positive"), ("too long and too slow", "negative"),
             ("a joy to watch", "positive"), ("the worst film of the year", "negative")]


def sentiment_records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [dict(zip(("text", "label"), rng.choice(SENTIMENT))) for _ in range(n)]


def make_raw(data_files, out_dir, strategy="fedavg", args=None, classification=False, **sections):
    """A raw tiny recipe (3 clients, 2 per round, 2 rounds, 2 local steps) for ``strategy``: tests/conftest.py's
    ``tiny_raw`` with ``max_length`` 48, or a tiny RoBERTa classifier on the sentiment file."""
    own = {"federation": {"strategy": strategy, "strategy_args": dict(args or {})}, "train": {"max_length": 48}}
    if classification:
        own.update(model={"name": "tiny-roberta"}, data={"format": "classification", "fields": {}})
    given = {k: {**own[k], **v} if isinstance(v, dict) and isinstance(own.get(k), dict) else v
             for k, v in sections.items()}
    return tiny_raw(out_dir, data_files["sentiment" if classification else "arith"], **{**own, **given})


def unit_recipe(**federation):
    """A parsed recipe for strategies used without the round loop (seed, comm dtype, LoRA init)."""
    return parse_recipe({"data": {"path": "unused.jsonl"}, "train": {"local_steps": 1},
                         "federation": {"num_clients": 3, **federation}})


def tiny(name="tiny-llama", r=4, alpha=8, seed=0, **model):
    """A tiny PEFT model with LoRA ``r``/``alpha`` (and its tokenizer)."""
    return load_model(ModelConfig(name=name, **model), LoraConfig(r=r, alpha=alpha), num_labels=2, seed=seed)


def make_strategy(name, model, num_clients=3, recipe=None, **args):
    strategy = get_strategy(name, **args)
    strategy.recipe = recipe if recipe is not None else unit_recipe()
    torch.manual_seed(1234)
    strategy.setup(model, [ClientInfo(c, 10 + 5 * c) for c in range(num_clients)])
    return strategy


@torch.no_grad()
def effective_weights(model) -> dict[str, torch.Tensor]:
    """What each LoRA-wrapped layer computes, read by feeding it the identity: ``out × in`` fp32 matrices.

    Independent of how a strategy stores its state (base weight, adapter, residual, kept factors,
    hooks): ``layer(I) = I·W̃ᵀ + bias``.
    """
    was = model.training
    model.eval()
    out = {}
    for name in lora_layers(model):
        module = model.get_submodule(name)
        eye = torch.eye(module.in_features)
        y = module(eye).float()
        bias = module.get_base_layer().bias
        if bias is not None:
            y = y - bias.float()
        out[name] = y.T.contiguous()
    model.train(was)
    return out


def base_weight_keys(model) -> dict[str, str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {name: names[id(layer.weight)] for name, layer in lora_layers(model).items()}


def fake_round(strategy, model, global_state, rnd, sampled, noise=1e-2, sizes=None, store=None):
    """One round without data: each sampled client loads its plan (with its entry of ``store``, a
    :class:`ClientStore`), moves every key it trains by seeded noise (standing in for local training),
    keeps its new entry and uploads; the server aggregates. Returns ``(new_global_state, uploads)``."""
    store = ClientStore() if store is None else store
    updates, uploads = [], {}
    for cid in sampled:
        plan = strategy.configure_client(rnd, cid, global_state)
        plan.client_state = store.get(cid)
        strategy.open_client(plan)
        write_state(model, {**plan.state, **plan.local})
        keys = [k for phase in plan.phases for k in (phase.keys if phase.keys is not None else plan.state)]
        gen = torch.Generator().manual_seed(1000 * rnd + cid)
        params = dict(model.named_parameters())
        trained = {k: v.clone() for k, v in {**plan.state, **plan.local}.items()}
        for k in dict.fromkeys(keys):
            trained[k] = params[k].detach() + noise * torch.randn(params[k].shape, generator=gen)
        write_state(model, trained)
        store.put(cid, strategy.close_client(plan, trained, 1))
        upload = strategy.client_upload(plan, trained, 1)
        uploads[cid] = upload
        updates.append(ClientUpdate(cid, upload, (sizes or {}).get(cid, 10), 0.0, 1))
    global_state = strategy.aggregate(rnd, global_state, updates)
    global_state = strategy.after_aggregate(rnd, model, global_state)
    write_state(model, global_state)
    return global_state, uploads


def record_updates(monkeypatch, strategy_cls) -> list:
    """Patch ``strategy_cls.aggregate`` to record every :class:`ClientUpdate` it receives (returned list)."""
    seen: list = []
    original = strategy_cls.aggregate

    def spy(self, rnd, global_state, updates):
        seen.extend(updates)
        return original(self, rnd, global_state, updates)

    monkeypatch.setattr(strategy_cls, "aggregate", spy)
    return seen


def record_rounds(monkeypatch, strategy_cls) -> list:
    """Patch ``strategy_cls.aggregate`` to record ``(rnd, global_state, updates, new_state)`` of every round it
    aggregates (copies, so an independent replay can recompute the round from what the server received)."""
    seen: list = []
    original = strategy_cls.aggregate

    def spy(self, rnd, global_state, updates):
        before = {k: v.clone() for k, v in global_state.items()}
        out = original(self, rnd, global_state, updates)
        seen.append((rnd, before, list(updates), {k: v.clone() for k, v in out.items()}))
        return out

    monkeypatch.setattr(strategy_cls, "aggregate", spy)
    return seen


def assert_recipe_refuses(data_files, tmp_path, strategy, bad_args, dp_reason):
    """Every key of ``bad_args`` is named in the recipe error, and client-level DP is refused with ``dp_reason``."""
    import pytest

    from fedllm.recipe.schema import RecipeError

    with pytest.raises(RecipeError) as err:
        parse_recipe(make_raw(data_files, tmp_path / "args", strategy, bad_args))
    for key in bad_args:
        assert f"federation.strategy_args.{key}" in str(err.value)
    privacy = {"mechanism": "central", "noise_multiplier": 0.5, "clipping_norm": 0.05}
    with pytest.raises(RecipeError, match=f"privacy.mechanism.*{strategy}.*{dp_reason}"):
        parse_recipe(make_raw(data_files, tmp_path / "dp", strategy, privacy=privacy))


def assert_dp_sgd_epsilon_per_client(result, noise_multiplier: float, batch_size: int, delta: float) -> list[dict]:
    """Every round's per-client ε of a DP-SGD run equals the accountant's for the steps that client took so far
    (sampling rate batch / its size), and the round's ε is their maximum; returns the run's metrics lines."""
    import json

    import pytest

    from fedllm.privacy import accounting

    lines = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps: dict[str, int] = {}
    for line in lines:
        for cid, s in line["client_steps"].items():
            steps[cid] = steps.get(cid, 0) + s
        want = {cid: accounting.dp_sgd_epsilon(noise_multiplier, batch_size / result.strategy.sizes[int(cid)], s, delta)
                for cid, s in steps.items()}
        assert line["client_epsilon"] == pytest.approx(want, rel=1e-9) and line["epsilon"] == max(want.values())
    return lines


def example_weights(layer, updates):
    total = sum(u.num_examples for u in updates)
    return [u.num_examples / total for u in updates]


def uniform_weights(layer, updates):
    return [1.0 / len(updates)] * len(updates)


def norm_weights(layer, updates):
    """HetLoRA's per-layer ``p_k = ‖B_kA_k‖_F / Σ_j ‖B_jA_j‖_F`` (Cho et al. 2024, Fig. 2b), on dense products."""
    norms = [torch.linalg.matrix_norm(u.state[layer.b_key].double() @ u.state[layer.a_key].double()) for u in updates]
    return [float(n / sum(norms)) for n in norms]


def padded_mean(key, updates, p, pad_to=None):
    """``Σ_k p_k x_k`` in float64, ``A`` rows / ``B`` columns zero-padded to ``pad_to`` (HetLoRA)."""
    out = 0
    for u, pk in zip(updates, p, strict=True):
        x = u.state[key].double()
        if pad_to is not None and ".lora_A." in key:
            x = torch.cat([x, x.new_zeros(pad_to - x.shape[0], x.shape[1])], 0)
        if pad_to is not None and ".lora_B." in key:
            x = torch.cat([x, x.new_zeros(x.shape[0], pad_to - x.shape[1])], 1)
        out = out + pk * x
    return out
