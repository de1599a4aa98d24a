"""LayerState.merged_weight (fedllm.export.weights): the merged export's fp32 weight of a layer, summed a block of
columns at a time, is the float64 merge ``W + (Σ s·B·A + R)`` rounded once, bit for bit as effective().float() (the
whole-matrix path it replaced), and check_explained compares every column."""

import torch

from fedllm.export import weights
from fedllm.export.factors import LowRank
from fedllm.export.weights import LayerState


def _state(monkeypatch, kept_in_base=False):
    monkeypatch.setattr(weights, "COLUMN_BLOCK", 16)  # 70 columns: blocks of 16, 16, 16, 16 and 6
    gen = torch.Generator().manual_seed(0)
    out, inp = 40, 70

    def rand(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=gen)

    adapter = [LowRank(rand(out, 4), rand(4, inp), 0.5), LowRank(rand(out, 2), rand(2, inp), 2.0)]
    kept = [LowRank(rand(out, 3), rand(3, inp), 0.25)]
    base = rand(out, inp).to(torch.bfloat16)
    residual = rand(out, inp, scale=1e-3)
    # the hand-computed float64 sums, in the order the layer's pieces are listed
    added = torch.zeros(out, inp, dtype=torch.float64)
    for piece in adapter + ([] if kept_in_base else kept):
        added = added + piece.scale * (piece.B.double() @ piece.A.double())
    added = added + residual.double()
    state = LayerState(name="layer", base=base, residual=residual, adapter=adapter, kept=kept,
                       kept_in_base=kept_in_base, observed=added.float(), scale=0.5)
    return state, (base.double() + added).float()


def test_the_merged_weight_is_the_float64_merge_rounded_once(monkeypatch):
    for kept_in_base in (False, True):
        state, want = _state(monkeypatch, kept_in_base)
        assert state.check_explained()
        got = state.merged_weight()
        assert got.dtype == torch.float32 and torch.equal(got, want)
        assert torch.equal(got, state.effective().float())


def test_a_difference_in_the_last_columns_is_seen_and_the_observed_addition_merged(monkeypatch):
    state, _ = _state(monkeypatch)
    state.observed[:, -1] += 1.0  # in the ragged last block only
    assert not state.check_explained()
    want = (state.base.double() + state.observed.double()).float()
    assert torch.equal(state.merged_weight(), want) and torch.equal(state.effective().float(), want)
