"""The client loop's per-step host work trimmed without changing a bit (issue #39: the loop was host-bound on a GPU).

The expectations are independent of fedllm's loop: torch's own per-parameter optimizers (``foreach=False``) and a
bare PEFT loop written here (zero_grad, ``model(**batch).loss``, backward, step) on the same micro-batches.
"""

import argparse
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from fedllm.data.collate import collate
from fedllm.engine.client import OPTIMIZERS, BatchStream, train_client
from fedllm.engine.server import build_federation, run
from fedllm.recipe.checks import parse_recipe
from fedllm.recipe.schema import TrainConfig
from fedllm.strategies.base import Phase

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_foreach_optimizers_match_the_per_parameter_loop_bit_for_bit(name):
    cfg = TrainConfig(weight_decay=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    shapes = [(8, 576), (576, 8), (4, 64), (64, 4), (16,)] * 3
    start = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) * 1e-2 for s in shapes] for _ in range(5)]
    per_parameter = {"adamw": lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.05, foreach=False),
                     "sgd": lambda p: torch.optim.SGD(p, lr=3e-3, momentum=0.9, weight_decay=0.05, foreach=False)}
    results = []
    for make in (partial(OPTIMIZERS[name], cfg=cfg, lr=3e-3), per_parameter[name]):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = make(params)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        results.append(params)
    assert OPTIMIZERS[name]([torch.nn.Parameter(torch.zeros(1))], cfg, 1e-3).defaults["foreach"] is True
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert not torch.equal(results[0][0], start[0])  # the steps moved the parameters


def test_compiled_training_on_a_cpu_takes_fused_adamw_within_rounding_of_foreach():
    """Under train.compile on a CPU AdamW is fused (one kernel); its steps stay within 1e-6 of foreach's."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(8, 576), (576, 8), (16,)]
    start = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) * 1e-2 for s in shapes] for _ in range(5)]
    results = []
    for cfg in (TrainConfig(weight_decay=0.05), TrainConfig(weight_decay=0.05, compile=True)):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = OPTIMIZERS["adamw"](params, cfg, 3e-3)
        assert (opt.defaults["fused"], opt.defaults["foreach"]) == ((True, None) if cfg.compile else (None, True))
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        results.append(params)
    for a, b, s in zip(*results, start):
        assert torch.allclose(a, b, rtol=0, atol=1e-6) and not torch.equal(a, s)


def test_client_training_equals_a_bare_peft_loop_bit_for_bit(tiny_recipe):
    recipe = parse_recipe(tiny_recipe(train={"loss_positions": "all", "local_steps": 3, "weight_decay": 0.01}))
    fed = build_federation(recipe)
    model, strategy, cfg = fed.loaded.model, fed.strategy, recipe.train
    coll = partial(collate, pad_id=fed.loaded.tokenizer.pad_token_id, task=fed.loaded.task)
    indices, seed = fed.data.clients[0], 1234
    keys = list(fed.global_keys)
    start = {k: v.detach().clone() for k, v in model.named_parameters() if k in keys}
    plan = strategy.configure_client(1, 0, start)
    plan.lr, plan.phases = cfg.lr, [Phase(steps=3)]
    model.eval()
    result = train_client(model, plan, strategy, fed.data.examples, indices, cfg, coll, seed)
    assert not model.training and not any(m.training for m in model.modules())  # left as it was

    params = dict(model.named_parameters())
    with torch.no_grad():
        for k, v in start.items():
            params[k].copy_(v)
    torch.manual_seed(seed)
    model.train()
    trained = [params[k] for k in keys]
    opt = torch.optim.AdamW(trained, lr=cfg.lr, weight_decay=0.01, foreach=False)
    stream, losses = BatchStream(indices, cfg.batch_size, seed), []
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        loss = model(**coll([fed.data.examples[i] for i in stream.next()])).loss
        losses.append(float(loss.detach()))
        loss.backward()
        opt.step()
    assert result.steps == 3 and result.optimizer_state is None
    assert result.loss == sum(losses) / 3
    assert all(torch.equal(result.state[k], params[k]) for k in keys)
    assert any(not torch.equal(result.state[k], start[k]) for k in keys)


def test_bench_bare_loops_leave_fedllm_run_untouched(tmp_path):
    """bench/step_overhead.py trains each round's micro-batches again in bare loops beside fedllm's clients; the
    federated run must come out as it does alone."""
    sys.path.insert(0, str(ROOT))
    from bench import step_overhead

    args = argparse.Namespace(rounds=2, steps=2, batch=2, max_length=24, dtype="fp32", device="cpu", threads=1)
    model_dir = step_overhead.build_model_dir(tmp_path / "model", layers=2, hidden=32, heads=2, vocab=1024)
    data = step_overhead.write_data(tmp_path / "train.jsonl", 16, shots=2)
    executor = step_overhead.one_trial(args, model_dir, data, tmp_path, 0)
    alone = run(step_overhead.recipe_for(model_dir, data, tmp_path / "alone", args), progress=False)
    assert [r["round"] for r in executor.rows] == [1, 2] and all(r["micro_batches"] == 4 for r in executor.rows)
    assert all(r[m][1] > 0 for r in executor.rows for m in step_overhead.MODES)
    assert [h["train_loss"] for h in executor.result.history] == [h["train_loss"] for h in alone.history]
    compared, reference = dict(executor.result.model.named_parameters()), dict(alone.model.named_parameters())
    assert all(torch.equal(p, reference[k]) for k, p in compared.items() if "lora_" in k)


def test_non_finite_key_reads_all_flags_at_once_and_names_the_first():
    from fedllm.engine.client_faults import non_finite_key

    state = {"a": torch.ones(3), "ids": torch.arange(4), "b": torch.tensor([1.0, float("nan")]),
             "c": torch.tensor([float("inf")]).bfloat16(), "d": torch.zeros(0)}
    assert non_finite_key(state) == "b"
    assert non_finite_key({k: v for k, v in state.items() if k != "b"}) == "c"
    assert non_finite_key({"a": state["a"], "ids": state["ids"], "d": state["d"]}) is None
    assert non_finite_key({}) is None


def test_supervised_positions_found_once_give_the_masked_values_and_gradients(tiny_recipe):
    """supervised_hidden gathers by one nonzero() instead of three boolean masks: the same values, rows and
    gradients as the masks give."""
    from fedllm.models.supervised_loss import base_of, supervised_hidden

    recipe = parse_recipe(tiny_recipe())
    fed = build_federation(recipe)
    model = fed.loaded.model
    coll = partial(collate, pad_id=fed.loaded.tokenizer.pad_token_id, task=fed.loaded.task)
    batch = coll([fed.data.examples[i] for i in fed.data.clients[0][:4]])
    hidden, targets, rows = supervised_hidden(model, batch)
    full = base_of(model).get_decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                        use_cache=False).last_hidden_state
    keep = batch["labels"][:, 1:] != -100
    assert 0 < int(keep.sum()) < keep.numel()
    assert torch.equal(hidden, full[:, :-1][keep]) and torch.equal(targets, batch["labels"][:, 1:][keep])
    assert torch.equal(rows, torch.arange(keep.shape[0])[:, None].expand_as(keep)[keep])
    weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(0))
    grads = []
    for h in (hidden, full[:, :-1][keep]):
        model.zero_grad(set_to_none=True)
        (h * weights).sum().backward(retain_graph=True)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])
