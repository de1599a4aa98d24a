"""Client-level DP (privacy.mechanism central / central_client_clipping) against Flower's DP strategy wrappers
and accountant, and its noise, adaptive norm and checkpointed state."""

import math

import numpy as np
import pytest
import torch
from flwr.serverapp import strategy as flower
from flwr.supercore.differential_privacy import compute_clip_model_update
from flwr.supercore.privacy_accounting import NeighboringRelation, PrivacyConfig, SamplingMethod
from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

from fedllm.privacy import accounting, with_privacy
from fedllm.privacy.central import ClientLevelDP
from fedllm.privacy.secret_streams import secret_of_seed
from fedllm.recipe.checks import parse_recipe
from fedllm.strategies import ClientUpdate, get_strategy
from tests.strategies.flower_reference import assert_equal_rounds, client_arrays, flower_rounds, initial_state

SIZES = [20, 20, 20]  # equal weights: Flower's accounted DP path needs them, and fedllm's DP mean is uniform
Z, C = 0.8, 0.5


def dp_strategy(mechanism="central", strategy="fedavg", clients=3, per_round=3, **privacy):
    recipe = parse_recipe({"data": {"path": "unused.jsonl"}, "train": {"local_steps": 1},
                           "federation": {"num_clients": clients, "clients_per_round": per_round, "rounds": 4,
                                          "strategy": strategy},
                           "privacy": {"mechanism": mechanism, "noise_multiplier": Z, "clipping_norm": C,
                                       "noise_seed": 0, **privacy}})
    s = with_privacy(get_strategy(strategy), recipe)
    s.recipe = recipe
    return s


def numpy_noise(monkeypatch):
    """fedllm draws its noise from numpy's global generator in Flower's order (Flower's ``np.random.normal``)."""
    monkeypatch.setattr(ClientLevelDP, "gaussian", staticmethod(
        lambda gen, shape, std: torch.from_numpy(np.asarray(np.random.normal(0, std, shape), dtype=np.float32))))


def run_fedllm(strategy, rounds=3, client_side=False):
    state = {k: torch.from_numpy(v) for k, v in initial_state().items()}
    out = []
    for rnd in range(1, rounds + 1):
        updates = []
        for cid, (up, n) in enumerate(zip(client_arrays(rnd, SIZES), SIZES, strict=True)):
            trained = {k: torch.from_numpy(v) for k, v in up.items()}
            if client_side:
                plan = strategy.configure_client(rnd, cid, state)
                trained = strategy.client_upload(plan, trained, 1)
            updates.append(ClientUpdate(cid, trained, n, 0.0, 1))
        state = strategy.aggregate(rnd, state, updates)
        out.append(state)
    return out


def flower_fedavg():
    return flower.FedAvg(min_train_nodes=3, min_available_nodes=3)


def test_server_side_fixed_clipping_equals_flower_with_the_same_noise(monkeypatch):
    np.random.seed(7)
    expected = flower_rounds(flower.DifferentialPrivacyServerSideFixedClipping(flower_fedavg(), Z, C, 3),
                             monkeypatch, SIZES, rounds=3)
    numpy_noise(monkeypatch)
    np.random.seed(7)
    got = run_fedllm(dp_strategy())
    assert_equal_rounds(expected, got, "server-side fixed clipping")
    np.random.seed(8)  # another noise draw moves the result: the noise is really there
    other = run_fedllm(dp_strategy())
    assert not torch.allclose(other[0]["classifier.weight"], got[0]["classifier.weight"], atol=1e-3)


def test_client_side_fixed_clipping_equals_flower_with_the_same_noise(monkeypatch):
    def clipped(rnd, sent):  # what Flower's fixedclipping_mod does on each client: clip against what it received
        out = []
        for up in client_arrays(rnd, SIZES):
            arrays = list(up.values())
            compute_clip_model_update(arrays, list(sent.values()), C)
            out.append(dict(zip(up, arrays, strict=True)))
        return out

    np.random.seed(3)
    expected = flower_loop(flower.DifferentialPrivacyClientSideFixedClipping(flower_fedavg(), Z, C, 3), clipped,
                           monkeypatch)
    numpy_noise(monkeypatch)
    np.random.seed(3)
    got = run_fedllm(dp_strategy("central_client_clipping"), client_side=True)
    assert_equal_rounds(expected, got, "client-side fixed clipping")


def flower_loop(strategy, uploads, monkeypatch, rounds=3):
    """Rounds of a Flower strategy whose clients upload ``uploads(rnd, arrays they received)``."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.app.message import arrayrecord
    from flwr.supercore.task_identity import TaskIdentity

    from tests.strategies.flower_reference import Grid

    for attr in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)
    monkeypatch.setattr(arrayrecord.gc, "collect", lambda *a: 0)
    current = initial_state()
    out = []
    for rnd in range(1, rounds + 1):
        arrays = ArrayRecord({k: Array(v) for k, v in current.items()})
        sent = list(strategy.configure_train(rnd, arrays, ConfigRecord(), Grid(3)))
        replies = [Message(RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in up.items()}),
                                       "metrics": MetricRecord({"num-examples": n})}), reply_to=msg)
                   for msg, up, n in zip(sent, uploads(rnd, current), SIZES, strict=True)]
        new, _ = strategy.aggregate_train(rnd, replies)
        current = {k: np.asarray(a.numpy()) for k, a in new.items()}
        out.append({k: v.astype(np.float64) for k, v in current.items()})
    return out


def test_adaptive_clipping_first_round_equals_flower_and_the_norm_follows_andrew_et_al(monkeypatch):
    """Round 1 (same initial norm, no noise) equals Flower's server-side adaptive wrapper; the norm then moves by
    Andrew et al.'s rule C·exp(−η(b − γ)) with b the *unclipped* fraction. (Flower 1.41 counts the *clipped*
    fraction there, so its norm shrinks when every update is clipped: docs/privacy.md.)"""
    flw = flower.DifferentialPrivacyServerSideAdaptiveClipping(flower_fedavg(), 0.0, 3, initial_clipping_norm=C)
    expected = flower_rounds(flw, monkeypatch, SIZES, rounds=1)
    s = dp_strategy(adaptive_clipping={"enabled": True, "count_stddev": 1.0})
    s.update_noise, s.count_stddev = 0.0, 0.0  # Flower's noise_multiplier 0: no noise at all
    got = run_fedllm(s, rounds=1)
    assert_equal_rounds(expected, got, "adaptive clipping, round 1")
    norms = [float(np.linalg.norm(np.concatenate([(v - initial_state()[k]).ravel() for k, v in up.items()])))
             for up in client_arrays(1, SIZES)]
    unclipped = sum(n <= C for n in norms) / 3
    assert s.clipping_norm == pytest.approx(C * math.exp(-0.2 * (unclipped - 0.5)), rel=1e-12)
    assert unclipped == 0 and s.clipping_norm > C > flw.clipping_norm  # all clipped: ours grows, Flower's shrinks


def test_adaptive_noise_splits_the_budget_as_flower_does():
    from flwr.supercore.differential_privacy import compute_adaptive_noise_params

    s = dp_strategy(adaptive_clipping={"enabled": True, "count_stddev": 1.0})
    assert s.update_noise == pytest.approx(compute_adaptive_noise_params(Z, 3, 1.0)[1], rel=1e-12)
    assert s.update_noise > Z


@pytest.mark.parametrize("clients,per_round,accounting_mode", [(3, 3, "no_amplification"),
                                                               (10, 4, "without_replacement")])
def test_epsilon_equals_flowers_accountant(clients, per_round, accounting_mode):
    s = dp_strategy(clients=clients, per_round=per_round, delta=1e-4)
    assert s.accounting == accounting_mode
    sampling = SamplingMethod.NO_AMPLIFICATION if accounting_mode == "no_amplification" else \
        SamplingMethod.WITHOUT_REPLACEMENT
    relation = NeighboringRelation.ADD_OR_REMOVE_ONE if accounting_mode == "no_amplification" else \
        NeighboringRelation.REPLACE_ONE
    flw = RdpAccountant(PrivacyConfig(target_delta=1e-4, population_size=clients, neighboring_relation=relation,
                                      sampling_method=sampling), orders=accounting.ORDERS)
    from flwr.supercore.privacy_accounting import GaussianPrivacyEvent

    # Flower's event carries the noise-to-sensitivity ratio: z for add/remove, z/2 for replace-one (sensitivity 2C)
    z = Z if accounting_mode == "no_amplification" else Z / 2
    for releases in (1, 3):
        while flw.num_releases < releases:
            flw.compose(GaussianPrivacyEvent(z, per_round, clients))
        assert s.epsilon_after(releases) == pytest.approx(flw.get_epsilon(1e-4), rel=1e-9)


def test_flowers_accounted_dp_strategy_reports_our_epsilon(monkeypatch):
    flw = flower.DifferentialPrivacyServerSideFixedClipping(
        flower_fedavg(), Z, C, 3, accountant=RdpAccountant(PrivacyConfig(
            target_delta=1e-5, population_size=3, neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
            sampling_method=SamplingMethod.NO_AMPLIFICATION), orders=accounting.ORDERS))
    flower_rounds(flw, monkeypatch, SIZES, rounds=3)
    s = dp_strategy()
    run_fedllm(s)
    assert s.round_record(3)["epsilon"] == pytest.approx(flw.privacy_spent().epsilon, rel=1e-9)


def test_target_epsilon_picks_the_smallest_noise_within_budget():
    s = dp_strategy(noise_multiplier=None, target_epsilon=3.0, clients=10, per_round=10)
    z = s.noise_multiplier
    eps = accounting.central_epsilon(s.accounting, z, 10, 10, 4, 1e-5)
    assert eps <= 3.0 and accounting.central_epsilon(s.accounting, z * 0.99, 10, 10, 4, 1e-5) > 3.0


def test_noise_has_the_stated_mean_and_std_and_is_secret_by_default():
    """Clients that upload the state they received: the aggregate is the state plus the noise alone."""
    s = dp_strategy(clients=4, per_round=4)
    s.pv.noise_seed = None
    s.noise_secret = None
    zero = {"w": torch.zeros(20000)}
    draws = torch.stack([s.aggregate(r, zero, [ClientUpdate(c, {"w": torch.zeros(20000)}, 1, 0.0, 1)
                                               for c in range(4)])["w"] for r in range(1, 6)])
    std = Z * C / 4
    assert abs(float(draws.mean())) < 5 * std / math.sqrt(draws.numel())
    assert float(draws.std()) == pytest.approx(std, rel=0.02)
    assert not torch.equal(draws[0], draws[1])  # a fresh draw every round
    other = dp_strategy(clients=4, per_round=4)
    other.pv.noise_seed, other.noise_secret = None, None
    again = other.aggregate(1, zero, [ClientUpdate(c, {"w": torch.zeros(20000)}, 1, 0.0, 1) for c in range(4)])
    assert not torch.equal(again["w"], draws[0])  # seeded from the OS, not from the recipe


def test_a_dropped_client_keeps_the_denominator_and_clipping_bounds_each_client():
    s = dp_strategy(clients=4, per_round=4)
    s.update_noise = 0.0
    g = {"w": torch.zeros(3)}
    big = ClientUpdate(0, {"w": torch.tensor([30.0, 40.0, 0.0])}, 5, 0.0, 1)  # norm 50, clipped to C
    out = s.aggregate(1, g, [big, ClientUpdate(1, {"w": torch.zeros(3)}, 7, 0.0, 1)])
    torch.testing.assert_close(out["w"], torch.tensor([0.6, 0.8, 0.0]) * C / 4)  # Σ clip / m, m = 4 sampled


def test_privacy_state_survives_a_checkpoint():
    s = dp_strategy("central", "fedadam", adaptive_clipping={"enabled": True, "count_stddev": 1.0})
    run_fedllm(s, rounds=2)
    saved = s.state_dict()
    assert {"privacy/clipping_norm", "privacy/releases", "privacy/noise_secret", "privacy/sampling_secret"} <= set(saved)
    restored = dp_strategy("central", "fedadam", adaptive_clipping={"enabled": True, "count_stddev": 1.0})
    restored.noise_secret = restored.sampling_secret = None
    restored.load_state_dict(saved)
    assert (restored.clipping_norm, restored.releases) == (s.clipping_norm, 2)
    assert restored.noise_secret == s.noise_secret == secret_of_seed(0) and len(s.noise_secret) == 32
    assert restored.moments.keys() == s.moments.keys()


def test_a_checkpoint_of_an_older_fedllm_resumes_from_its_integer_seeds_with_a_warning(caplog):
    """Before issue 49 the secrets were 63-bit integers (``privacy/noise_seed``, ``privacy/sampling_seed``; -1: not
    drawn): a resume continues from them, hashed into the ChaCha20 streams, and says they are only that secret."""
    s = dp_strategy()
    old = {"privacy/clipping_norm": torch.tensor(0.5, dtype=torch.float64), "privacy/releases": torch.tensor(2),
           "privacy/noise_seed": torch.tensor(123456789), "privacy/sampling_seed": torch.tensor(-1)}
    s.load_state_dict(old)
    assert s.noise_secret == secret_of_seed(123456789) and s.sampling_secret is None and s.releases == 2
    assert "noise_seed is a 63-bit integer" in caplog.text


def test_adaptive_clipping_releases_centred_bits_so_its_epsilon_is_the_mechanisms():
    """Audit case (issue 34): 4 of 4 clients, z = 1.5, σ_b = 1. The count the adaptive norm releases is of centred
    bits (Andrew et al., Alg. 1): one client added or removed moves it by ½, so the update noise z_Δ and the count
    noise together are a Gaussian of multiplier z, and the ε fedllm reports is dp-accounting's for the mechanism as
    it runs. A plain count (moved by 1) made that multiplier 0.915: ε 10.04 where 5.59 was reported."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    from fedllm.privacy.central import adaptive_noise, centred_count, noised_unclipped_fraction

    bits = [True, False, True]
    moved = {abs(centred_count(bits + [b]) - centred_count(bits)) for b in (True, False)}
    assert moved == {0.5}  # the sensitivity of what is released, whatever the client's bit
    s = dp_strategy(clients=4, per_round=4, noise_multiplier=1.5,
                    adaptive_clipping={"enabled": True, "count_stddev": 1.0})
    assert s.update_noise == pytest.approx(adaptive_noise(1.5, 1.0), rel=1e-12)
    combined = (s.update_noise ** -2 + (s.count_stddev / max(moved)) ** -2) ** -0.5
    assert combined == pytest.approx(1.5, rel=1e-12)
    assert (s.update_noise ** -2 + s.count_stddev ** -2) ** -0.5 == pytest.approx(0.915, abs=5e-4)  # a plain count
    rounds = 4
    accountant = rdp_privacy_accountant.RdpAccountant(orders=accounting.ORDERS)
    accountant.compose(dp_event.GaussianDpEvent(combined), rounds)
    assert s.epsilon_after(rounds) == pytest.approx(accountant.get_epsilon(s.pv.delta), rel=1e-9)
    # the fraction estimate: with every sampled client reporting it is the plain noised fraction, as before
    assert noised_unclipped_fraction(centred_count([True, False, True, True]), 4) == pytest.approx(0.75)
    assert noised_unclipped_fraction(centred_count([True, False, True]), 4) == pytest.approx(0.625)  # one dropped


def test_the_adaptive_norm_moves_by_the_centred_estimate_when_a_sampled_client_drops():
    """4 sampled, 3 report (all clipped), no count noise: b̃ = Σ(b − ½)/4 + ½ = 0.125 (a plain count gave 0)."""
    s = dp_strategy(clients=4, per_round=4, adaptive_clipping={"enabled": True, "count_stddev": 1.0})
    s.update_noise, s.count_stddev = 0.0, 0.0
    run_fedllm(s, rounds=1)
    assert s.last["unclipped"] == 0
    assert s.clipping_norm == pytest.approx(C * math.exp(-0.2 * (0.125 - 0.5)), rel=1e-12)
