"""DPO through the real round loop with every strategy, the reference kept per client, resume and export.

Independent expectations: at a client's first step the policy *is* the reference (the model training started
from), so with one local step every client of round 1 reports DPO's loss at Δ = 0, ``log 2``, whatever the
strategy does to the base (FRLoRA's SVD split, FedLoRU's merges, private factors ...); the adapter-disabled base
of a FedAvg run is the policy it started from, so it reproduces the stored reference log-probabilities, and a
run that takes its reference that way trains the same adapter.
"""

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from strategy_helpers import write_jsonl
from test_e2e import CASES

from fedllm.data.collate import collate
from fedllm.engine.reference import REFERENCE_KEY
from fedllm.engine.server import run
from fedllm.models.preference_loss import adapter_disabled, sequence_logps
from fedllm.recipe.checks import parse_recipe
from tests.conftest import tiny_raw
from tests.preference_helpers import preference_records


@pytest.fixture(scope="module")
def pref_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("pref") / "pairs.jsonl", preference_records(36))


def dpo_raw(out_dir, data_path, /, strategy="fedavg", args=None, **sections):
    """A tiny DPO recipe: 3 clients, 2 per round, 2 rounds, 2 local steps, the tiny tokenizer's chat template."""
    own = {
        "data": {"path": str(data_path), "format": "preference", "fields": {}},
        "federation": {"strategy": strategy, "strategy_args": dict(args or {})},
        "train": {"objective": "dpo", "max_length": 48, "lr": 5e-2, "preference": {"beta": 0.5}},
    }
    for key, value in sections.items():
        own[key] = {**own.get(key, {}), **value} if isinstance(value, dict) else value
    return tiny_raw(out_dir, data_path, **own)


@pytest.mark.parametrize("case", sorted(c for c, (_, _, sections) in CASES.items() if "lora" not in sections))
def test_preference_dpo_runs_with_every_strategy(case, pref_file, tmp_path, monkeypatch):
    import fedllm.engine.client as client_module
    import fedllm.engine.server as server_module

    losses: list = []  # every micro-batch loss, None where a client's training starts
    dpo, run_client = client_module.OBJECTIVES["dpo"], server_module.run_client

    def recorded(model, batch, cfg):
        loss = dpo(model, batch, cfg)
        losses.append(float(loss.detach()))
        return loss

    def marked(*args, **kwargs):
        losses.append(None)
        return run_client(*args, **kwargs)

    monkeypatch.setitem(client_module.OBJECTIVES, "dpo", recorded)
    monkeypatch.setattr(server_module, "run_client", marked)
    strategy, args, sections = CASES[case]
    result = run(
        parse_recipe(
            dpo_raw(
                tmp_path / "run", pref_file, strategy, args, federation={"rounds": 1}, train=sections.get("train", {})
            )
        )
    )
    firsts = [losses[i + 1] for i, x in enumerate(losses) if x is None]
    assert len(firsts) == 2  # the round's two clients
    for loss in firsts:  # a client's first step: its policy is the reference, Δ = 0
        assert loss == pytest.approx(math.log(2), abs=1e-5), case
    assert any(x is not None and abs(x - math.log(2)) > 1e-6 for x in losses), "no step moved the policy"
    refs = result.clients.references()
    assert sorted(refs) == [0, 1, 2] and all(REFERENCE_KEY in r for r in refs.values())
    assert all(bool(torch.isfinite(r[REFERENCE_KEY]).all()) for r in refs.values())


def client_logps_adapter_disabled(recipe, result, cid: int) -> torch.Tensor:
    """Client ``cid``'s (chosen, rejected) answer log-probabilities under the adapter-disabled final model."""
    from fedllm.data.federated import build_federated_data

    data = build_federated_data(
        recipe.data,
        recipe.federation.partition,
        recipe.federation.num_clients,
        result.tokenizer,
        recipe.train.max_length,
        recipe.seed,
    )
    examples = data.client_examples(cid)
    model = result.model.eval()
    rows = []
    with adapter_disabled(model):
        for ex in examples:  # one pair at a time: no padding, a batching independent of fedllm's
            lp = sequence_logps(model, collate([ex], result.tokenizer.pad_token_id)).logps
            rows.append(lp)
    return torch.stack(rows)


def test_preference_precomputed_reference_equals_adapter_disabled_fedavg(pref_file, tmp_path):
    recipe = parse_recipe(dpo_raw(tmp_path / "pre", pref_file))
    pre = run(recipe)
    for cid, part in pre.clients.references().items():
        expected = client_logps_adapter_disabled(recipe, pre, cid)
        torch.testing.assert_close(part[REFERENCE_KEY], expected, atol=1e-5, rtol=1e-6)
    disabled = run(
        parse_recipe(
            dpo_raw(tmp_path / "dis", pref_file, train={"preference": {"beta": 0.5, "reference": "adapter_disabled"}})
        )
    )
    assert disabled.clients.references() == {}  # nothing precomputed on that path
    for a, b in zip(pre.history, disabled.history, strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-5)
    before = load_file(str(pre.run_dir / "final" / "adapter.safetensors"))
    after = load_file(str(disabled.run_dir / "final" / "adapter.safetensors"))
    for key in before:
        torch.testing.assert_close(before[key], after[key], atol=1e-5, rtol=1e-4)
    assert pre.history[-1]["train_loss"] < math.log(2)  # it learned something


def test_preference_resume_is_bit_exact_and_exports(pref_file, tmp_path, crash_at_round):
    raw = dpo_raw(tmp_path / "cut", pref_file, "frlora", federation={"rounds": 3}, checkpoint={"every": 1})
    whole = run(parse_recipe({**raw, "output_dir": str(tmp_path / "whole")}))
    crash_at_round(3)
    with pytest.raises(RuntimeError, match="power cut"):
        run(parse_recipe(raw))
    crash_at_round(None)
    resumed = run(parse_recipe(raw), resume=True)
    for part in ("adapter", "clients", "base"):
        a = load_file(str(whole.run_dir / "final" / f"{part}.safetensors"))
        b = load_file(str(resumed.run_dir / "final" / f"{part}.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part
    clients = load_file(str(resumed.run_dir / "final" / "clients.safetensors"))
    assert {k for k in clients if k.endswith(REFERENCE_KEY)} == {f"client{c}/{REFERENCE_KEY}" for c in range(3)}

    from fedllm.export.api import export

    for fmt in ("merged", "adapter"):  # each export checks that it reproduces the run's model
        export(resumed.run_dir, fmt, tmp_path / fmt)
        assert any((tmp_path / fmt).iterdir())


def test_preference_pref_accuracy_is_the_implicit_reward_recomputed(pref_file, tmp_path):
    """pref_accuracy's numbers, recomputed by hand from plain forward passes of the final model (with and
    without its adapter: FedAvg never changes the base) on the run's held-out pairs."""
    raw = dpo_raw(
        tmp_path / "acc",
        pref_file,
        data={"eval_fraction": 0.25},
        eval={"tasks": ["pref_accuracy"], "before_training": True},
    )
    recipe = parse_recipe(raw)
    result = run(recipe)
    start, end = result.history[0]["eval"], result.history[-1]["eval"]
    assert start["pref_accuracy/accuracy"] == 0.0 and start["pref_accuracy/margin"] == 0.0  # policy == reference

    from fedllm.data.federated import build_federated_data

    data = build_federated_data(
        recipe.data,
        recipe.federation.partition,
        recipe.federation.num_clients,
        result.tokenizer,
        recipe.train.max_length,
        recipe.seed,
    )
    model, beta = result.model.eval(), recipe.train.preference.beta

    def logp(ids: list, labels: list) -> float:
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
        target = torch.tensor(labels[1:])
        keep = target != -100
        return float(torch.log_softmax(logits, -1)[keep].gather(-1, target[keep][:, None]).sum())

    rewards = []
    with torch.no_grad():
        for ex in data.eval_examples:
            seqs = [(ex["input_ids"], ex["labels"]), (ex["rejected_input_ids"], ex["rejected_labels"])]
            policy = [logp(*s) for s in seqs]
            with model.disable_adapter():
                ref = [logp(*s) for s in seqs]
            rewards.append([beta * (p - r) for p, r in zip(policy, ref, strict=True)])
    assert len(rewards) == 9
    accuracy = sum(c > r for c, r in rewards) / len(rewards)
    margin = sum(c - r for c, r in rewards) / len(rewards)
    assert end["pref_accuracy/accuracy"] == pytest.approx(accuracy, abs=1e-9)
    assert end["pref_accuracy/margin"] == pytest.approx(margin, abs=1e-5)
    assert end["pref_accuracy/margin"] > 0  # it learned to prefer the correct sums

    # fedllm eval of the run's checkpoint: the same pairs, the references the run kept, the same numbers
    from fedllm.commands.cli import main

    assert (
        main(["eval", str(result.run_dir), "--tasks", "pref_accuracy", "--out", str(tmp_path / "ev"), "--no-progress"])
        == 0
    )
    again = json.loads((tmp_path / "ev" / "summary.json").read_text())["metrics"]
    assert again == pytest.approx(end, abs=1e-6)


def test_the_evaluation_before_round_1_takes_the_policy_from_the_reference_table(pref_file, tmp_path, monkeypatch):
    """Before round 1 the model is the one the held-out pairs' reference log-probabilities were just computed from:
    pref_accuracy makes no forward pass of its own there and reports what the pass it skips gives (a run whose
    round-0 evaluation is made to compute it); the later evaluation runs its passes, and both runs end alike."""
    import fedllm.engine.server as server_module
    import fedllm.evaluation.tasks.preference as task_module

    passes: list[int] = []  # the pairs of each policy pass pref_accuracy makes
    real = task_module.sequence_logps
    monkeypatch.setattr(task_module, "sequence_logps",
                        lambda model, batch, *a, **k: passes.append(int(batch["pairs"])) or real(model, batch, *a, **k))
    sections = {"data": {"eval_fraction": 0.25}, "eval": {"tasks": ["pref_accuracy"], "before_training": True}}
    read = run(parse_recipe(dpo_raw(tmp_path / "read", pref_file, **sections)))
    read_passes, passes[:] = list(passes), []
    evaluate = server_module.RoundLoop.evaluate
    monkeypatch.setattr(server_module.RoundLoop, "evaluate",
                        lambda self, rnd, *a, reference_policy=False, **k: evaluate(self, rnd, *a, **k))
    computed = run(parse_recipe(dpo_raw(tmp_path / "computed", pref_file, **sections)))
    assert sum(read_passes) == 9 and sum(passes) == 18  # the 9 held-out pairs: once (the end), twice (start, end)
    start, start_computed = read.history[0]["eval"], computed.history[0]["eval"]
    assert start["pref_accuracy/margin"] == 0.0 and start["pref_accuracy/accuracy"] == 0.0
    assert start["pref_accuracy/logp_accuracy"] == start_computed["pref_accuracy/logp_accuracy"]
    assert 0 < start["pref_accuracy/logp_accuracy"] < 1  # the model's own preferences, not a constant
    assert start == pytest.approx(start_computed, abs=1e-6)
    assert read.history[-1]["eval"] == computed.history[-1]["eval"]


@pytest.mark.parametrize("mechanism", ["central", "central_client_clipping"])
def test_preference_dpo_with_client_level_dp(mechanism, pref_file, tmp_path):
    """Client-level DP wraps a DPO client's update as any other: clipped, noised, accounted."""
    privacy = {"mechanism": mechanism, "noise_multiplier": 0.5, "clipping_norm": 0.05, "noise_seed": 3,
               "per_client_stats": True}  # the round's train_loss is compared
    everyone = {"clients_per_round": 3}  # under client-level DP the sample comes from a secret seed: the same
    plain = run(parse_recipe(dpo_raw(tmp_path / "plain", pref_file, federation=everyone)))  # clients only with all
    private = run(parse_recipe(dpo_raw(tmp_path / "dp", pref_file, privacy=privacy, federation=everyone)))
    assert private.history[-1]["epsilon"] > 0
    assert private.history[0]["train_loss"] == pytest.approx(plain.history[0]["train_loss"], abs=1e-6)  # round 1
    a = load_file(str(plain.run_dir / "final" / "adapter.safetensors"))
    b = load_file(str(private.run_dir / "final" / "adapter.safetensors"))
    assert any(not torch.allclose(a[k], b[k]) for k in a)  # the aggregate is clipped and noised


def test_preference_eval_client_uses_the_references_the_run_stored(pref_file, tmp_path, monkeypatch, caplog):
    """``fedllm eval RUN --client all`` of a personalized DPO run whose strategy merges into the base (pFedLoRU,
    tau 1: the base moves every round): each client's pairs carry the reference log-probabilities the run stored
    for its split, so every client's pref_accuracy equals the run's own evaluation of that personal model in the
    last round; with the stored references hidden it falls back to the adapter-disabled (merged) base, says so,
    and scores differently."""
    from fedllm.commands.cli import main
    from fedllm.runs.client_store import ClientStore

    raw = dpo_raw(tmp_path / "personal", pref_file, "pfedloru",
                  {"tau": 1, "personal_r": 2, "personal_steps": 1, "global_steps": 2},
                  data={"client_eval_fraction": 0.34, "eval_fraction": 0.2},
                  eval={"tasks": ["pref_accuracy"], "personal": True})
    result = run(parse_recipe(raw))
    in_run = result.history[-1]["personal_eval"]
    assert len(in_run) == 3

    def client_eval(out):
        assert main(["eval", str(result.run_dir), "--client", "all", "--out", str(out), "--no-progress"]) == 0
        return json.loads((out / "personal_summary.json").read_text())["clients"]

    again = client_eval(tmp_path / "ev")
    assert again.keys() == in_run.keys()
    for cid, metrics in in_run.items():
        assert again[cid] == pytest.approx(metrics, abs=1e-6), cid

    monkeypatch.setattr(ClientStore, "reference", lambda self, cid: {})  # a checkpoint that kept no references
    with caplog.at_level("WARNING", logger="fedllm"):
        disabled = client_eval(tmp_path / "ev-disabled")
    assert "the adapter-disabled base is the reference" in caplog.text
    gaps = [abs(disabled[c]["pref_accuracy/margin"] - in_run[c]["pref_accuracy/margin"]) for c in in_run]
    assert max(gaps) > 1e-2, gaps  # the merged base is not the policy training started from


def test_preference_reference_pass_is_cached_across_a_resume_before_the_first_checkpoint(pref_file, tmp_path,
                                                                                           crash_at_round,
                                                                                           monkeypatch):
    """A run cut in round 1 (no checkpoint yet) leaves its reference tables in RUN/reference_logps.safetensors; the
    resumed start computes none again and trains exactly as an uninterrupted run. A cache of another recipe is
    ignored."""
    import fedllm.engine.reference as reference
    from fedllm.runs.reference_cache import CACHE_NAME

    computed: list[int] = []
    original = reference.compute_references

    def counted(model, examples, clients, *args, **kwargs):
        computed.append(sum(len(ix) for ix in clients.values()))
        return original(model, examples, clients, *args, **kwargs)

    monkeypatch.setattr(reference, "compute_references", counted)
    raw = dpo_raw(tmp_path / "cut", pref_file, federation={"rounds": 2})
    whole = run(parse_recipe({**raw, "output_dir": str(tmp_path / "whole")}))
    pairs = computed.pop()
    assert pairs > 0
    crash_at_round(1)
    with pytest.raises(RuntimeError, match="power cut"):
        run(parse_recipe(raw))
    crash_at_round(None)
    assert computed.pop() == pairs and (tmp_path / "cut" / CACHE_NAME).is_file()
    assert not (tmp_path / "cut" / "checkpoints").exists() or not any((tmp_path / "cut" / "checkpoints").iterdir())
    resumed = run(parse_recipe(raw), resume=True)
    assert computed.pop() == 0   # every client's table read back
    for k in whole.global_state:
        assert torch.equal(whole.global_state[k], resumed.global_state[k]), k
    other = dpo_raw(tmp_path / "other", pref_file, federation={"rounds": 2}, train={"lr": 1e-2})
    crash_at_round(1)
    with pytest.raises(RuntimeError, match="power cut"):
        run(parse_recipe(other))
    crash_at_round(None)
    computed.clear()
    (tmp_path / "other" / CACHE_NAME).write_bytes((tmp_path / "cut" / CACHE_NAME).read_bytes())
    run(parse_recipe(other), resume=True)
    assert computed == [pairs]   # the cache of another recipe (lr differs): computed again
