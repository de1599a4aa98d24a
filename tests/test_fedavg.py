import torch

from fedllm.strategies import ClientUpdate, get_strategy


def _update(cid, n, a, b):
    return ClientUpdate(cid, {"lora_A": torch.tensor(a), "lora_B": torch.tensor(b)}, n, 0.0, 1)


def test_fedavg_weights_by_examples_against_hand_computed_values():
    updates = [_update(0, 10, [[1.0, 2.0]], [[0.0], [4.0]]), _update(1, 30, [[5.0, -2.0]], [[8.0], [0.0]])]
    out = get_strategy("fedavg").aggregate(1, {}, updates)
    # A: (10*[1,2] + 30*[5,-2]) / 40 = [4, -1];  B: (10*[0,4] + 30*[8,0]) / 40 = [6, 1]
    assert torch.equal(out["lora_A"], torch.tensor([[4.0, -1.0]]))
    assert torch.equal(out["lora_B"], torch.tensor([[6.0], [1.0]]))


def test_fedavg_uniform():
    updates = [_update(0, 10, [[1.0, 2.0]], [[0.0], [4.0]]), _update(1, 30, [[5.0, -2.0]], [[8.0], [0.0]])]
    out = get_strategy("fedavg", weighting="uniform").aggregate(1, {}, updates)
    assert torch.equal(out["lora_A"], torch.tensor([[3.0, 0.0]]))
    assert torch.equal(out["lora_B"], torch.tensor([[4.0], [2.0]]))


def test_fedavg_refuses_mismatched_updates():
    import pytest

    from fedllm.models.state import StateMismatch

    bad = [_update(0, 1, [[1.0, 2.0]], [[0.0], [4.0]]),
           ClientUpdate(1, {"lora_A": torch.zeros(1, 2)}, 1, 0.0, 1)]
    with pytest.raises(StateMismatch):
        get_strategy("fedavg").aggregate(1, {}, bad)
