"""train.compile with the strategies whose clients change what the decoder layers compute: forward hooks on the
LoRA layers (FRLoRA's residual, pFedLoRU's private adapter, mFedLoRU's nested factors, Fed-SB's latent matrix,
pFL^MF's factorised pieces, FlexLoRA's DoRA stacks) and factors trained one at a time (RoLoRA: requires_grad
changing between rounds); FRLoRA also with ``train.gradient_checkpointing`` (its hooks run again in the recompute).

Under dynamo's ``eager`` backend (tracing, guards and graphs, no code generation) a compiled run's final adapter
(and base, where the strategy merges into it) equals, bit for bit in fp32, the eager run that fuses its loss and
AdamW as the compiled run does: dynamo traced the hooks and re-traced wherever a guard failed. (Inductor's kernels
would round differently; the wiring is what this checks.) A second run in the same process never replays a graph
traced with the first run's hooks (``skip_nnmodule_hook_guards`` off while a client trains). No strategy's hook
breaks the layer's graph: a break made dynamo trace every frame below it (pFL^MF's leaf copy of ``U``, made inside
its hook, took 16 graphs and 34 frames where 3 graphs do).

The runs train on micro-batches of one example: never padded, so transformers passes the layers no attention mask
and dynamo traces no masked variant of each layer's graph (a compiled run under the eager backend: pFL^MF 5 graphs
where batches of 4 took 7, 8.3 -> 6.0 CPU-s; RoLoRA 7 -> 5, 9.7 -> 4.8). Padded batches under ``train.compile``:
tests/training/test_compile.py.
"""

import pytest
import torch
from safetensors.torch import load_file

from fedllm.engine import client, compiled
from fedllm.engine.server import run
from fedllm.models import supervised_loss
from fedllm.recipe.checks import parse_recipe

CASES = {
    "frlora": ("frlora", {}),
    "pfedloru": ("pfedloru", {"personal_r": 2, "personal_steps": 1, "tau": 2}),
    "mfedloru": ("mfedloru", {}),
    "fed_sb": ("fed_sb", {}),
    "pflmf": ("pflmf", {}),
    "flexlora-ranks": ("flexlora", {"client_ranks": [2, 4, 3]}),
    "rolora": ("rolora", {}),
}


@pytest.fixture
def eager_compile(monkeypatch):
    """dynamo's eager backend; the eager run fuses its loss and AdamW as a compiled CPU run does; no graph left
    from an earlier test."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(compiled, "BACKEND", "eager")
    monkeypatch.setattr(supervised_loss, "FUSE_FROM_BYTES", 0)
    monkeypatch.setattr(client, "adamw_kernel", lambda params, cfg: {"fused": True})
    torch._dynamo.reset()
    counters.clear()
    return counters


def _final(tiny_recipe, out_dir, case, **train):
    strategy, args = CASES[case]
    recipe = parse_recipe(tiny_recipe(output_dir=str(out_dir), train={"batch_size": 1, **train}, federation={
        "num_clients": 3, "clients_per_round": 2, "rounds": 2, "strategy": strategy, "strategy_args": args}))
    return {f.name: load_file(str(f)) for f in (run(recipe).run_dir / "final").glob("*.safetensors")}


def _assert_equal(a, b):
    assert a.keys() == b.keys() and "adapter.safetensors" in a
    for f in a:
        assert a[f].keys() == b[f].keys()
        differ = [k for k in a[f] if not torch.equal(a[f][k], b[f][k])]
        assert not differ, f"{f}: {differ[:3]}"


SECOND_RUN = ("mfedloru", "pfedloru")  # compared in test_a_second_run_does_not_replay_the_first_runs_hooks


@pytest.mark.parametrize("case", sorted(set(CASES) - set(SECOND_RUN)))
def test_a_compiled_run_equals_the_eager_run(case, tiny_recipe, tmp_path, eager_compile):
    eager = _final(tiny_recipe, tmp_path / "eager", case)
    compiled_run = _final(tiny_recipe, tmp_path / "compiled", case, compile=True)
    assert eager_compile["stats"]["unique_graphs"] >= 1
    assert not eager_compile["graph_break"], dict(eager_compile["graph_break"])
    _assert_equal(eager, compiled_run)
    if case == "frlora":  # each compiled layer's call runs its checkpointed forward (its recompute in the backward):
        both = _final(tiny_recipe, tmp_path / "both", case, compile=True, gradient_checkpointing=True)
        assert both.keys() == eager.keys()  # within 1e-6 of each tensor's largest value (bit for bit on this CPU)
        for f in eager:
            assert both[f].keys() == eager[f].keys()
            for k, a in eager[f].items():
                torch.testing.assert_close(both[f][k], a, rtol=0, atol=1e-6 * float(a.abs().max()), msg=f"{f}:{k}")


def test_a_second_run_does_not_replay_the_first_runs_hooks(tiny_recipe, tmp_path, eager_compile):
    """mFedLoRU hooks its nested factors on the LoRA layers; pFedLoRU then hooks private adapters on new layers of
    the same class. With dynamo's default (hooks unguarded) pFedLoRU's compiled run replayed mFedLoRU's graph. Each
    compiled run equals its eager run."""
    for case in SECOND_RUN:
        _assert_equal(_final(tiny_recipe, tmp_path / f"{case}-eager", case),
                      _final(tiny_recipe, tmp_path / case, case, compile=True))
    assert not eager_compile["graph_break"], dict(eager_compile["graph_break"])


def test_a_second_run_does_not_replay_before_isolate_recompiles(tiny_recipe, tmp_path, eager_compile, monkeypatch):
    """The same under a torch.compile without ``isolate_recompiles`` (torch 2.11, the lent GPU image's): each
    compiled function gets a code object of its own, and so a graph cache of its own."""
    real = torch.compile
    seen = []

    def compile_before_2_13(fn=None, *, dynamic=None, backend="inductor", mode=None, fullgraph=False, options=None,
                            disable=False):
        if fn.__name__ == "_layer_call":  # not the CPU head's chunk (compiled apart)
            seen.append(fn.__code__)
        return real(fn, dynamic=dynamic, backend=backend, mode=mode, fullgraph=fullgraph, options=options,
                    disable=disable)

    monkeypatch.setattr(torch, "compile", compile_before_2_13)
    for case in SECOND_RUN:
        _assert_equal(_final(tiny_recipe, tmp_path / f"{case}-eager", case),
                      _final(tiny_recipe, tmp_path / case, case, compile=True))
    assert len(seen) >= 2 and len({id(c) for c in seen}) == len(seen)
    assert all(c is not compiled._layer_call.__code__ for c in seen)
