"""Bulyan against the paper (El Mhamdi et al. 2018, Alg. "Bulyan": recursive Krum selection, then a coordinate-wise
trimmed mean around the median) written here from its equations, and against Flower's legacy
``aggregate_bulyan``; ``bulyan_multikrum`` is Flower's one-shot Message-API selection, which differs."""

import numpy as np
import pytest
import torch

from fedllm.strategies import ClientUpdate, get_strategy

SHAPES = {"a": (3, 4), "b": (5,)}


def paper_bulyan(vectors: np.ndarray, f: int) -> np.ndarray:
    """Bulyan of the rows of ``vectors`` (n × d, fp64), from the paper: S ← ∅, R ← all; θ = n − 2f times, add to
    S the element of R with the least Krum score within R (sum of squared distances to its |R| − f − 2 nearest in
    R, at least one), remove it from R; then β = θ − 2f and each coordinate is the mean of the β values of S
    closest to S's median there."""
    n = len(vectors)
    theta, beta = n - 2 * f, n - 4 * f
    remaining, chosen = list(range(n)), []
    while len(chosen) < theta:
        scores = []
        for i in remaining:
            d = sorted(float(np.sum((vectors[i] - vectors[j]) ** 2)) for j in remaining if j != i)
            scores.append(sum(d[: max(1, len(remaining) - f - 2)]))
        pick = remaining[int(np.argmin(scores))]
        chosen.append(pick)
        remaining.remove(pick)
    sel = vectors[chosen]
    med = np.median(sel, axis=0)
    out = np.empty(sel.shape[1])
    for c in range(sel.shape[1]):
        out[c] = sel[np.argsort(np.abs(sel[:, c] - med[c]), kind="stable")[:beta], c].mean()
    return out


def oneshot_bulyan(vectors: np.ndarray, f: int) -> np.ndarray:
    """The same trimmed mean over the θ best Krum scores computed once over all n (Flower's Message-API class)."""
    n = len(vectors)
    d = ((vectors[:, None] - vectors[None]) ** 2).sum(-1)
    scores = [np.sort(row)[1 : max(1, n - f - 2) + 1].sum() for row in d]
    sel = vectors[np.argsort(scores, kind="stable")[: n - 2 * f]]
    med = np.median(sel, axis=0)
    return np.array(
        [sel[np.argsort(np.abs(sel[:, c] - med[c]), kind="stable")[: n - 4 * f], c].mean() for c in range(sel.shape[1])]
    )


def random_case(seed: int) -> tuple[list[dict[str, np.ndarray]], int]:
    """n updates (7..15, f as large as n ≥ 4f + 3 allows, at least 1) around two or three centres with a few
    far ones: settings where the recursive and the one-shot selections often disagree."""
    rng = np.random.default_rng(seed)
    f = int(rng.integers(1, 3))
    n = int(rng.integers(4 * f + 3, 4 * f + 9))
    centres = rng.normal(size=(int(rng.integers(2, 4)), 17)) * rng.uniform(0.2, 3.0)
    rows = centres[rng.integers(0, len(centres), n)] + rng.normal(size=(n, 17)) * rng.uniform(0.05, 1.0)
    far = rng.random(n) < 0.15
    rows[far] *= rng.uniform(2, 20)
    rows = rows.astype(np.float32)
    return [{"a": r[:12].reshape(3, 4), "b": r[12:]} for r in rows], f


def flat(state) -> np.ndarray:
    return np.concatenate([np.asarray(state[k], dtype=np.float64).ravel() for k in SHAPES])


def fedllm_bulyan(name: str, arrays: list[dict[str, np.ndarray]], f: int) -> np.ndarray:
    updates = [
        ClientUpdate(c, {k: torch.from_numpy(v) for k, v in a.items()}, 10, 0.0, 1) for c, a in enumerate(arrays)
    ]
    start = {k: torch.zeros(s) for k, s in SHAPES.items()}
    out = get_strategy(name, num_malicious_clients=f).aggregate(1, start, updates)
    assert all(out[k].dtype == torch.float32 and tuple(out[k].shape) == s for k, s in SHAPES.items())
    return flat({k: v.double().numpy() for k, v in out.items()})


CASES = range(240)


def test_bulyan_equals_the_papers_recursive_krum_and_flowers_legacy_aggregate_bulyan():
    legacy = pytest.importorskip("flwr.server.strategy.aggregate")
    differ = 0
    for seed in CASES:
        arrays, f = random_case(seed)
        vectors = np.stack([flat(a) for a in arrays])
        want = paper_bulyan(vectors, f)
        np.testing.assert_allclose(fedllm_bulyan("bulyan", arrays, f), want, rtol=0, atol=1e-6, err_msg=f"case {seed}")
        results = [([a["a"], a["b"]], 10) for a in arrays]
        flower = legacy.aggregate_bulyan(list(results), f, legacy.aggregate_krum, to_keep=0)
        np.testing.assert_allclose(
            np.concatenate([x.ravel() for x in flower]).astype(np.float64),
            want,
            rtol=0,
            atol=1e-5,
            err_msg=f"legacy case {seed}",
        )
        oneshot = oneshot_bulyan(vectors, f)
        np.testing.assert_allclose(
            fedllm_bulyan("bulyan_multikrum", arrays, f), oneshot, rtol=0, atol=1e-6, err_msg=f"one-shot case {seed}"
        )
        differ += not np.allclose(oneshot, want, rtol=0, atol=1e-6)
    # 196 of these 240 cases differ (the audit's cases: 70 of 240): the test tells the two selections apart
    assert differ >= 120, f"only {differ} of {len(CASES)} cases tell the two selections apart"


def test_bulyan_keeps_the_paper_selection_where_one_shot_multikrum_differs():
    """The first random case where the selections differ: ``bulyan`` gives the paper's, not the one-shot one."""
    for seed in CASES:
        arrays, f = random_case(seed)
        vectors = np.stack([flat(a) for a in arrays])
        if not np.allclose(oneshot_bulyan(vectors, f), paper_bulyan(vectors, f), atol=1e-6):
            got = fedllm_bulyan("bulyan", arrays, f)
            assert not np.allclose(got, fedllm_bulyan("bulyan_multikrum", arrays, f), atol=1e-6)
            np.testing.assert_allclose(got, paper_bulyan(vectors, f), rtol=0, atol=1e-6)
            return
    pytest.fail("no random case where the selections differ")
