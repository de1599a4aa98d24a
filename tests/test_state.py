import pytest
import torch

from fedllm.models import state


def test_weighted_mean_matches_hand_computation():
    a = {"x": torch.tensor([1.0, 2.0]), "y": torch.tensor([[0.0]])}
    b = {"x": torch.tensor([3.0, 6.0]), "y": torch.tensor([[4.0]])}
    m = state.weighted_mean([a, b], [1, 3])
    # (1*[1,2] + 3*[3,6]) / 4 = [2.5, 5.0]; (0 + 12) / 4 = 3
    assert torch.equal(m["x"], torch.tensor([2.5, 5.0]))
    assert torch.equal(m["y"], torch.tensor([[3.0]]))


def test_weighted_mean_keeps_dtype_and_accumulates_in_fp32():
    a = {"x": torch.tensor([1.0], dtype=torch.bfloat16)}
    b = {"x": torch.tensor([2.0], dtype=torch.bfloat16)}
    m = state.weighted_mean([a, b], [1, 1])
    assert m["x"].dtype == torch.bfloat16 and m["x"].item() == 1.5


def test_key_and_shape_mismatch_are_errors():
    with pytest.raises(state.StateMismatch, match="different keys"):
        state.add({"a": torch.zeros(1)}, {"b": torch.zeros(1)})
    with pytest.raises(state.StateMismatch, match="shape"):
        state.sub({"a": torch.zeros(1)}, {"a": torch.zeros(2)})
    with pytest.raises(state.StateMismatch):
        state.weighted_mean([{"a": torch.zeros(2)}, {"a": torch.zeros(3)}], [1, 1])


def test_clone_does_not_share_storage():
    p = torch.nn.Parameter(torch.ones(3))
    c = state.clone({"p": p})
    with torch.no_grad():
        p.add_(1)
    assert torch.equal(c["p"], torch.ones(3))


def test_num_bytes_and_cast():
    s = {"a": torch.zeros(10, 4)}
    assert state.num_bytes(s) == 160
    assert state.num_bytes(s, "bf16") == 80
    x = {"a": torch.tensor([1.0 + 2**-12])}
    assert state.cast(x, "bf16")["a"].item() == 1.0 and state.cast(x, "bf16")["a"].dtype == torch.float32
