"""train.clients_per_pass: K clients in one pass equal K sequential clients (LoRA dropout 0)."""

import pytest
import torch

from fedllm.engine.server import run
from fedllm.models.loading import load_model
from fedllm.recipe.checks import parse_recipe
from fedllm.recipe.schema import RecipeError

STRATEGIES = ["fedavg", "frlora", "fedprox"]
ARGS = {"fedprox": {"mu": 50.0}}  # a proximal term strong enough to change the result


def _recipe(tiny_recipe, ragged_file, out, strategy, k, **train):
    return parse_recipe(tiny_recipe(
        output_dir=str(out), data={"path": str(ragged_file)},
        federation={"num_clients": 4, "clients_per_round": 3, "rounds": 2, "strategy": strategy,
                    "strategy_args": ARGS.get(strategy, {})},
        train={"local_steps": 3, "batch_size": 3, "grad_accum": 2, "max_length": 96, "lr": 5e-3,
               "clients_per_pass": k, **train}))


@pytest.fixture
def passes(monkeypatch):
    """Records the client ids of every batched pass (so a test knows the batched path ran)."""
    import fedllm.engine.batched_clients as bc

    seen, real = [], bc.train_clients

    def spy(model, plans, *args, **kwargs):
        seen.append([p.client_id for p in plans])
        return real(model, plans, *args, **kwargs)

    monkeypatch.setattr(bc, "train_clients", spy)
    return seen


def _final(result):
    """Every weight of the final model (FRLoRA merges into the base, so the adapter alone says little)."""
    return {k: v.detach().clone() for k, v in result.model.state_dict().items()}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_batched_pass_equals_sequential_training(tiny_recipe, ragged_file, tmp_path, strategy, passes):
    # clients_per_pass 2 with 3 clients per round: a pass of 2 and a pass of 1; max_grad_norm clips per client
    extra = {"max_grad_norm": 0.5, "weight_decay": 0.01}
    seq = run(_recipe(tiny_recipe, ragged_file, tmp_path / "seq", strategy, 1, **extra))
    assert passes == []
    bat = run(_recipe(tiny_recipe, ragged_file, tmp_path / "bat", strategy, 2, **extra))
    assert [len(p) for p in passes] == [2, 2]  # one batched pass of two clients per round
    a, b = _final(seq), _final(bat)
    assert a.keys() == b.keys()
    recipe = _recipe(tiny_recipe, ragged_file, tmp_path / "init", strategy, 1)
    init = load_model(recipe.model, recipe.lora, seed=0).model.state_dict()
    moved = {k for k in a if not torch.allclose(a[k], init[k], atol=1e-4)}
    # training moved the LoRA factors (FedAvg) or the base weights it merges into (FRLoRA)
    assert any(("lora_" in k) == (strategy != "frlora") for k in moved), sorted(moved)[:5]
    if strategy == "fedprox":  # the proximal term acted in the batched pass too
        plain = _final(run(_recipe(tiny_recipe, ragged_file, tmp_path / "avg", "fedavg", 2, **extra)))
        assert any(not torch.allclose(plain[k], b[k], rtol=1e-3, atol=1e-5) for k in a)
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6), (k, float((a[k] - b[k]).abs().max()))
    for hs, hb in zip(seq.history, bat.history, strict=True):
        assert hs["clients"] == hb["clients"]
        for c, loss in hs["client_loss"].items():
            assert abs(loss - hb["client_loss"][c]) < 1e-5 * abs(loss), (c, loss, hb["client_loss"][c])


def test_clipping_is_per_client(tiny_recipe, ragged_file, tmp_path, passes):
    """A tight max_grad_norm changes the result, and batched still matches sequential (each client its own norm)."""
    seq = run(_recipe(tiny_recipe, ragged_file, tmp_path / "seq", "fedavg", 1, max_grad_norm=1e-3))
    bat = run(_recipe(tiny_recipe, ragged_file, tmp_path / "bat", "fedavg", 3, max_grad_norm=1e-3))
    free = run(_recipe(tiny_recipe, ragged_file, tmp_path / "free", "fedavg", 3))
    assert [len(p) for p in passes] == [3, 3, 3, 3]
    a, b, f = _final(seq), _final(bat), _final(free)
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)
    assert any(not torch.allclose(a[k], f[k], rtol=1e-2, atol=1e-4) for k in a)


@pytest.mark.parametrize("section,value,why", [
    ({"federation": {"strategy": "pfedloru"}}, None, "does not support client-batched|without declaring"),
    ({"train": {"optimizer_state": "per_client"}}, None, "per_client"),
    ({"train": {"dtype": "fp16"}}, None, "fp16"),
])
def test_recipes_that_cannot_batch_say_so_at_load(tiny_recipe, section, value, why):
    raw = tiny_recipe(**section)
    raw["train"]["clients_per_pass"] = 2
    with pytest.raises(RecipeError, match=why) as e:
        parse_recipe(raw)
    assert "train.clients_per_pass" in str(e.value)


def test_the_class_that_changes_the_client_side_must_vouch_for_batching():
    from fedllm.strategies import get_strategy
    from fedllm.strategies.fedavg import FedAvg

    for name in ("fedavg", "frlora", "frlora_v1", "fedprox"):
        assert type(get_strategy(name)).client_batching_problem() is None, name
    for name in ("pfedloru", "fedsa_lora"):
        assert type(get_strategy(name)).client_batching_problem() is not None, name

    class Silent(FedAvg):
        name = "silent"

        def client_loss(self, model, plan):
            return None

    class Vouched(Silent):
        client_batching = True

    class Corrects(Vouched):
        client_batching = True

        def after_step(self, model, plan):
            pass

    assert "without declaring" in Silent.client_batching_problem()
    assert Vouched.client_batching_problem() is None
    assert "after_step" in Corrects.client_batching_problem()
