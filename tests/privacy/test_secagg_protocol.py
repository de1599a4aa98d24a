"""SecAgg+ protocol units (fedllm.privacy.secagg): masks cancel, self masks are removed, a masked vector looks
uniform and carries nothing of its input, quantisation is unbiased within its bound, the weighted sum and the
dropout path (``pytest -k secagg``)."""

import numpy as np
import pytest
import torch

from fedllm.privacy.secagg import SecAggClient, SecAggError, SecAggParams, SecAggServer, crypto, identity, masks
from fedllm.privacy.secagg.encoding import decode, encode, layout_of
from fedllm.privacy.secagg.graph import neighbour_graph
from fedllm.privacy.secagg.messages import SurvivorSignature
from fedllm.privacy.secagg.quantize import dequantize_sum, quantize
from fedllm.privacy.secagg.rounds import secure_sum

P = SecAggParams(threshold=3, neighbours=4, quantization_range=1.0, quantization_bits=16, max_dropouts=1)
IDS = [0, 1, 2, 3, 4, 5, 6, 7]


def words(seed, n=5000, high=1 << 16):
    return {c: np.random.default_rng([seed, c]).integers(0, high, n, dtype=np.uint32) for c in IDS}


def exact_sum(inputs, skip=()):
    return sum(v.astype(np.uint64) for c, v in inputs.items() if c not in skip).astype(np.uint32)


def staged(params=P, ids=IDS):
    """Clients (with simulated identity keys) and server after the key and share exchange; returns (clients, server,
    routed shares)."""
    who, registered = identity.simulated(ids)
    clients = {c: SecAggClient(c, params, ids, b"graph", b"ctx", who[c]) for c in ids}
    server = SecAggServer(params, ids, b"graph", b"ctx", registered)
    keys = server.route_keys([c.advertise() for c in clients.values()])
    routed = server.route_shares([s for c in clients.values() for s in c.share_keys(keys[c.id])])
    return clients, server, routed


def test_secagg_pairwise_masks_cancel_and_self_masks_are_what_remains():
    inputs = words(0)
    clients, _, routed = staged()
    masked = {c: clients[c].mask(inputs[c], routed[c]).vector for c in IDS}
    self_masks = {c: masks.expand(clients[c].seed, 5000, np.uint32) for c in IDS}
    left = sum(masked[c].astype(np.uint64) - self_masks[c].astype(np.uint64) for c in IDS).astype(np.uint32)
    assert np.array_equal(left, exact_sum(inputs))  # every pairwise mask cancelled in the sum
    assert not np.array_equal(sum(masked[c].astype(np.uint64) for c in IDS).astype(np.uint32), exact_sum(inputs))


def test_secagg_sum_is_exact_with_the_self_masks_removed():
    inputs = words(1)
    result = secure_sum(P, inputs, b"graph", b"ctx")
    assert np.array_equal(result.total, exact_sum(inputs)) and result.request.dropped == ()
    assert all(not np.array_equal(m.vector, inputs[m.client_id]) for m in result.received)


def test_secagg_a_masked_vector_is_uniform_and_uncorrelated_with_its_input():
    """A real-sized structured update (a smooth, large-magnitude signal): its masked form has correlation ≈ 0 with
    it and uniform 32-bit words (mean 2^31, std 2^32/√12, flat top byte)."""
    n = 500_000
    x = np.sin(np.linspace(0, 40, n)) * 0.5
    q = quantize(x, P, np.random.default_rng(0))
    inputs = {c: q for c in IDS}
    result = secure_sum(P, inputs, b"graph", b"ctx")
    for m in result.received:
        y = m.vector.astype(np.float64)
        assert abs(np.corrcoef(y, q.astype(np.float64))[0, 1]) < 0.01
        assert abs(y.mean() / 2**32 - 0.5) < 0.005 and abs(y.std() / 2**32 - 12**-0.5) < 0.005
        counts = np.bincount((m.vector >> 24).astype(np.int64), minlength=256)
        chi2 = ((counts - n / 256) ** 2 / (n / 256)).sum()
        assert chi2 < 400  # 255 degrees of freedom: p < 1e-6 above ~370
    assert np.array_equal(result.total, exact_sum(inputs))


def test_secagg_masks_come_from_a_256_bit_chacha20_stream():
    seed = bytes(range(32))
    a = masks.expand(seed, 1000, np.uint64)
    assert np.array_equal(a, masks.expand(seed, 1000, np.uint64))  # a seed expands to one mask
    flipped = masks.expand(bytes([1]) + seed[1:], 1000, np.uint64)
    assert np.count_nonzero(a == flipped) == 0  # one bit of the seed changes every word
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    stream = Cipher(algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor().update(bytes(4000))
    assert np.array_equal(masks.expand(seed, 1000, np.uint32), np.frombuffer(stream, "<u4"))
    with pytest.raises(ValueError, match="32 bytes"):
        masks.expand(seed[:4], 10, np.uint32)


def test_secagg_quantization_is_unbiased_and_within_one_step():
    x = np.random.default_rng(2).uniform(-1, 1, 20_000)
    params = SecAggParams(threshold=2, neighbours=2, quantization_bits=4)  # a coarse grid: Δ = 2/15
    rng = np.random.default_rng(3)
    trials = np.stack([dequantize_sum(quantize(x, params, rng), 1, params) for _ in range(400)])
    assert np.abs(trials - x).max() < params.step  # each value within one step
    assert np.abs(trials.mean(0) - x).max() < 5 * params.step / 2 / np.sqrt(400)  # unbiased (5 sigma)
    assert abs((trials - x).mean()) < 1e-3
    clipped = dequantize_sum(quantize(np.array([-3.0, 2.5]), params, rng), 1, params)
    assert np.array_equal(clipped, [-1.0, 1.0])  # beyond the range: clipped to it


def test_secagg_weighted_sum_gives_the_fedavg_mean_within_the_bound():
    """Clients upload w·q(δ) and w: the decoded weighted mean is within Δ of Σ w δ / Σ w per coordinate, and the
    unweighted keys' mean within Δ of the plain mean."""
    params = SecAggParams(threshold=3, neighbours=4, quantization_range=0.5, quantization_bits=18, max_dropouts=1)
    gen = torch.Generator().manual_seed(0)
    ref = {"a": torch.randn(64, 32, generator=gen), "c": torch.zeros(10)}
    ups = {
        c: {
            "a": ref["a"] + 0.3 * torch.randn(64, 32, generator=gen).clamp(-1.5, 1.5),
            "c": torch.randn(10, generator=gen).clamp(-1.5, 1.5) * 0.3,
        }
        for c in IDS
    }
    weights = {c: 10 + 7 * c for c in IDS}
    layout = layout_of(ups[0], lambda k: k != "c")
    rng = np.random.default_rng(4)
    inputs = {c: encode(ups[c], {"a": ref["a"]}, weights[c], layout, params, rng)[0] for c in IDS}
    result = secure_sum(params, inputs, b"graph", b"ctx", lost_after_sharing=frozenset({5}))
    decoded = decode(result.total, layout, params)
    kept = [c for c in IDS if c != 5]
    assert decoded.weight == sum(weights[c] for c in kept) and decoded.count == len(kept)
    means = decoded.means(layout)
    want_a = sum(weights[c] * (ups[c]["a"].double() - ref["a"].double()) for c in kept) / decoded.weight
    want_c = sum(ups[c]["c"].double() for c in kept) / len(kept)
    assert (means["a"] - want_a).abs().max() < params.step and (means["c"] - want_c).abs().max() < params.step
    assert (means["a"] - want_a).abs().max() > 0  # quantised: not bit-equal


def test_secagg_dropouts_up_to_the_limit_complete_beyond_it_fail_loudly():
    params = SecAggParams(threshold=4, neighbours=6, max_dropouts=2)
    inputs = words(5)
    result = secure_sum(params, inputs, b"graph", b"ctx", lost_after_sharing=frozenset({2, 6}))
    assert result.request.dropped == (2, 6) and np.array_equal(result.total, exact_sum(inputs, (2, 6)))
    with pytest.raises(SecAggError, match=r"3 clients \(\[1, 2, 6\]\) were lost after sharing.*max_dropouts=2"):
        secure_sum(params, inputs, b"graph", b"ctx", lost_after_sharing=frozenset({1, 2, 6}))


def test_secagg_too_few_shares_fail_loudly():
    clients, server, routed = staged()
    inputs = words(6)
    request = server.collect_masked([clients[c].mask(inputs[c], routed[c]) for c in IDS if c != 0])
    signatures = server.collect_signatures([SurvivorSignature(c, clients[c].check(request)) for c in request.survivors])
    reveals = [r for c in request.survivors for r in clients[c].unmask(request, signatures)
               if r.owner != 0 or r.holder == 1]
    with pytest.raises(SecAggError, match="1 shares of client 0's masking key arrived, fewer than the share thres"):
        server.unmask(reveals)


def test_secagg_a_client_never_reveals_both_secrets_of_a_neighbour():
    clients, _, routed = staged()
    inputs = words(7)
    for c in IDS:
        clients[c].mask(inputs[c], routed[c])
    from fedllm.privacy.secagg import UnmaskRequest

    with pytest.raises(SecAggError, match="both secrets"):
        clients[0].check(UnmaskRequest(tuple(IDS), (clients[0].neighbours[0],)))
    with pytest.raises(SecAggError, match="not the list it signed"):  # unsigned: nothing revealed
        clients[0].unmask(UnmaskRequest(tuple(IDS), (clients[0].neighbours[0],)), {})


def test_secagg_shares_are_authenticated():
    from fedllm.privacy.secagg import EncryptedShare

    clients, _, routed = staged()
    s = routed[0][0]
    forged = EncryptedShare(s.sender, s.receiver, s.sealed[:-1] + bytes([s.sealed[-1] ^ 1]))
    with pytest.raises(SecAggError, match="fails authentication"):
        clients[0].mask(words(8)[0], [forged])
    moved = EncryptedShare(routed[1][0].sender, 0, routed[1][0].sealed)  # a share for client 1 sent to client 0
    if moved.sender in clients[0].peers:
        with pytest.raises(SecAggError, match="fails authentication"):
            clients[0].mask(words(8)[0], [moved])


def test_secagg_shamir_from_pycryptodome_rebuilds_32_byte_secrets_from_any_threshold():
    secret = bytes(range(32))
    shares = crypto.split(secret, 3, 5)
    assert crypto.combine({1: shares[0], 3: shares[2], 5: shares[4]}) == secret
    assert crypto.combine({2: shares[1], 4: shares[3]}) != secret


def test_secagg_neighbour_graph_is_regular_symmetric_and_public():
    ids = list(range(3, 40, 2))
    g = neighbour_graph(ids, 6, b"round-1")
    assert g == neighbour_graph(ids, 6, b"round-1") and g != neighbour_graph(ids, 6, b"round-2")
    assert all(len(v) == 6 and c not in v for c, v in g.items())
    assert all(c in g[v] for c, vs in g.items() for v in vs)
    assert all(len(v) == 4 for v in neighbour_graph(ids[:5], 9, b"x").values())  # complete when k >= n - 1


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"threshold": 2, "neighbours": 4}, "more than half"),
        (
            {"threshold": 4, "neighbours": 4, "max_dropouts": 1},
            "threshold must be .*at most neighbours - max_dropouts = 3",
        ),
        ({"threshold": 3, "neighbours": 4, "mod_bits": 16}, "mod_bits must be 32 or 64"),
        ({"threshold": 3, "neighbours": 4, "quantization_bits": 32}, r"quantization_bits must be in \[1, 31\]"),
    ],
)
def test_secagg_bad_parameters_are_refused(kwargs, message):
    with pytest.raises(SecAggError, match=message):
        SecAggServer(SecAggParams(**kwargs), IDS, b"g", b"c")
