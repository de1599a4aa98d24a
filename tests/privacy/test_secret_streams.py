"""Issue 49 item 4: every stream a privacy guarantee rests on is a ChaCha20 stream keyed by the whole 256-bit secret.

The audit found the central-DP noise and the secret client sample seeded through ``derived_seed``, which keeps 48
bits of its input: ``noise_seed`` s and s XOR 2⁵⁰ gave the same samples, the same noise and a bit-identical
aggregate. Here a flip of any one of the secret's 256 bits (and of ``noise_seed``'s bits above 48) changes the noise
and the sample, the Gaussians are Gaussians (moments, Kolmogorov-Smirnov against scipy), and a stream is a function
of its key alone (reproducible, prefix-stable)."""

import math

import numpy as np
import pytest
import torch
from scipy import stats

from fedllm.engine.server import sample_clients
from fedllm.privacy import secret_streams, with_privacy
from fedllm.privacy.dp_sgd import LocalDPSGD
from fedllm.privacy.secret_streams import gaussian, secret_of_seed, stream_key
from fedllm.recipe.checks import parse_recipe
from fedllm.strategies import ClientUpdate, get_strategy

SECRET = bytes(range(32))


def flipped(secret: bytes, bit: int) -> bytes:
    value = bytearray(secret)
    value[bit // 8] ^= 1 << (bit % 8)
    return bytes(value)


def central_dp(noise_seed=0):
    recipe = parse_recipe({"data": {"path": "unused.jsonl"}, "train": {"local_steps": 1},
                           "federation": {"num_clients": 100, "clients_per_round": 10, "rounds": 3},
                           "privacy": {"mechanism": "central", "noise_multiplier": 1.0, "clipping_norm": 1.0,
                                       "noise_seed": noise_seed}})
    s = with_privacy(get_strategy("fedavg"), recipe)
    s.recipe = recipe
    return s


def released(strategy, rnd=1):
    """Round ``rnd``'s aggregate of 10 clients that upload what they were sent: the noise alone."""
    zero = {"w": torch.zeros(64)}
    return strategy.aggregate(rnd, zero, [ClientUpdate(c, {"w": torch.zeros(64)}, 1, 0.0, 1) for c in range(10)])["w"]


def test_gaussians_have_the_moments_and_distribution_of_a_normal():
    n = 400_000
    x = gaussian(stream_key(SECRET, "test", 1), (n,), std=1.0).double().numpy()
    se = 1 / math.sqrt(n)
    assert abs(x.mean()) < 5 * se
    assert abs(x.var() - 1) < 5 * math.sqrt(2) * se  # Var of the sample variance: 2/n
    assert abs(stats.skew(x)) < 5 * math.sqrt(6) * se
    assert abs(stats.kurtosis(x)) < 5 * math.sqrt(24) * se  # excess kurtosis 0
    assert stats.kstest(x, "norm").pvalue > 1e-3
    pairs = x[: n // 2 * 2].reshape(-1, 2)  # Box-Muller's two outputs of one pair are independent
    assert abs(np.corrcoef(pairs[:, 0], pairs[:, 1])[0, 1]) < 5 * math.sqrt(2) * se
    scaled = gaussian(stream_key(SECRET, "test", 1), (n,), std=0.25).double().numpy()
    np.testing.assert_allclose(scaled, 0.25 * x, rtol=1e-6)


def test_a_stream_is_a_function_of_its_key_alone():
    key = stream_key(SECRET, "central-dp", 3, "tensor", "w")
    a = gaussian(key, (3, 1001), 0.5)
    assert torch.equal(a, gaussian(key, (3, 1001), 0.5))  # bit-exact: a resume recomputes round 3's noise
    assert torch.equal(gaussian(key, (1000,), 0.5), a.flatten()[:1000])  # a prefix of a longer draw (even length)
    chunked = gaussian(key, (secret_streams.CHUNK + 10,), 0.5)  # across a chunk boundary, one continuing stream
    assert torch.equal(chunked[:3003], a.flatten()[:3003]) and chunked.dtype == torch.float32
    assert not torch.equal(a, gaussian(stream_key(SECRET, "central-dp", 4, "tensor", "w"), (3, 1001), 0.5))
    assert stream_key(SECRET, "a", 12, 3) != stream_key(SECRET, "a", 1, 23)  # parts are length-prefixed
    assert torch.equal(gaussian(key, (5,), 0.0), torch.zeros(5))


def test_the_draw_is_one_keystream_whatever_the_chunks_and_threads():
    """Box-Muller by hand on the key's ChaCha20 keystream read in one piece (IV of zeros) gives the values on both
    sides of the first chunk boundary, with 2 threads and with 1."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    key, n = stream_key(SECRET, "chunks"), secret_streams.CHUNK + 10
    words = np.frombuffer(Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor().update(bytes(8 * n)),
                          dtype="<u8")
    u = (words >> np.uint64(11)).astype(np.float64) * 2.0**-53
    radius = np.sqrt(-2 * np.log(u[0::2] + 2.0**-53))
    by_hand = np.stack((radius * np.cos(2 * np.pi * u[1::2]), radius * np.sin(2 * np.pi * u[1::2])), 1).reshape(-1)
    threads = torch.get_num_threads()
    try:
        draws = []
        for count in (2, 1):
            torch.set_num_threads(count)
            draws.append(gaussian(key, (n,)))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(draws[0], draws[1])
    around = slice(secret_streams.CHUNK - 6, n)
    np.testing.assert_allclose(draws[0][around].double().numpy(), by_hand[around], rtol=1e-6, atol=1e-7)


def test_flipping_any_bit_of_the_secret_changes_the_noise_and_the_sample():
    """The noise of a tensor as :meth:`ClientLevelDP.aggregate` draws it (its key and Gaussian), and the sample, for
    each of the 256 one-bit flips of the secret (the aggregate itself: the next test and the first round here)."""
    dp = central_dp()
    dp.noise_secret = dp.sampling_secret = SECRET
    noise = dp.gaussian(dp.noise_key(1, "tensor", "w"), (64,), 0.1)
    torch.testing.assert_close(released(dp), noise, rtol=1e-6, atol=1e-8)  # 10 of 10 clients: std z·C/10 = 0.1
    sample = [sample_clients(SECRET, r, 100, 10) for r in (1, 2, 3)]
    for bit in range(256):
        dp.noise_secret = dp.sampling_secret = flipped(SECRET, bit)
        assert not torch.equal(dp.gaussian(dp.noise_key(1, "tensor", "w"), (64,), 0.1), noise), bit
        assert [sample_clients(dp.sampling_seed(0), r, 100, 10) for r in (1, 2, 3)] != sample, bit


@pytest.mark.parametrize("bit", [48, 50, 62])
def test_noise_seeds_differing_above_bit_48_give_different_noise_and_samples(bit):
    """The audit's case: ``noise_seed`` s and s XOR 2^bit (derived_seed masked every input to 48 bits; the recipe
    takes a signed 64-bit seed)."""
    s = 0x1234_5678_9ABC
    a, b = central_dp(s), central_dp(s ^ (1 << bit))
    assert not torch.equal(released(a), released(b))
    assert [sample_clients(a.sampling_seed(0), r, 100, 10) for r in (1, 2, 3)] != \
        [sample_clients(b.sampling_seed(0), r, 100, 10) for r in (1, 2, 3)]
    assert a.noise_secret == secret_of_seed(s) and b.noise_secret == secret_of_seed(s ^ (1 << bit))


def test_the_secret_sample_is_uniform_and_retries_leave_out_the_failed_clients():
    counts = np.zeros(20)
    for r in range(1, 2001):
        drawn = sample_clients(SECRET, r, 20, 5)
        assert len(set(drawn)) == 5 and drawn == sorted(drawn)
        counts[drawn] += 1
    assert stats.chisquare(counts).pvalue > 1e-3  # each client in 1/4 of the samples
    retry = sample_clients(SECRET, 1, 20, 5, attempt=1, exclude=frozenset(sample_clients(SECRET, 1, 20, 5)))
    assert not set(retry) & set(sample_clients(SECRET, 1, 20, 5)) and len(retry) == 5
    assert sample_clients(SECRET, 1, 3, 5, attempt=1, exclude=frozenset({0})) == [1, 2]  # as many as are left


def test_dp_sgd_noise_and_poisson_draws_are_the_secrets_chacha20_streams():
    """An empty Poisson batch takes a noise-only step: with SGD (lr 1) the change is exactly the ChaCha20 Gaussians
    of (secret, phase 0, step 0, parameter i) over the expected batch, in place of opacus's torch.Generator draw."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    params = list(model.parameters())
    start = [p.detach().clone() for p in params]
    dp = LocalDPSGD(1.5, clipping_norm=0.4, batch_size=4, num_examples=16, secret=SECRET)
    with dp.phase(model, torch.optim.SGD(params, lr=1.0)) as stepper:
        stepper.zero_grad(set_to_none=True)
        dp.empty_batch(params)
        stepper.step()
    for i, (p, p0) in enumerate(zip(params, start, strict=True)):
        want = gaussian(stream_key(SECRET, "dp-sgd-noise", 0, 0, i), p.shape, 1.5 * 0.4) / 4
        torch.testing.assert_close(p0 - p.detach(), want, rtol=1e-6, atol=1e-7)
    draws = [LocalDPSGD(1.0, 1.0, 4, 16, secret=s).stream(range(16)) for s in (SECRET, SECRET, flipped(SECRET, 200))]
    first = [[d.next() for _ in range(5)] for d in draws]
    assert first[0] == first[1] != first[2]
    want = secret_streams.bernoulli(stream_key(SECRET, "dp-sgd-poisson", 0), 16, 4 / 16)
    assert first[0][0] == [i for i in range(16) if want[i]]
