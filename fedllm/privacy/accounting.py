"""Privacy accounting with Google's ``dp-accounting`` (Rényi DP, the library Flower's accountant wraps).

Client-level DP (``privacy.mechanism: central*``): each round releases the clients' clipped updates summed with
Gaussian noise of std ``z·C``. fedllm samples ``m`` of ``N`` clients uniformly *without replacement*, so:

- ``accounting: without_replacement`` (default): each round is a ``SampledWithoutReplacementDpEvent(N, m)`` of a
  Gaussian under the *replace-one* neighbouring relation (Wang, Balle & Kasiviswanathan 2019, Thm. 27). Replacing
  one client's update changes the clipped sum by up to ``2C``, so the Gaussian's noise-to-sensitivity ratio is ``z/2``.
- ``accounting: no_amplification``: each round is a plain ``GaussianDpEvent(z)`` under add/remove-one-client
  (sensitivity ``C``): what Flower's DP strategies account (its ``no-amplification``). Exact when every client
  trains every round; with a partial sample one client's update can displace another's (sensitivity ``2C``), so
  the recipe check allows it only with full participation.
- ``accounting: auto`` (the default): ``no_amplification`` with full participation, else ``without_replacement``.

Sample-level DP-SGD (``dp_sgd``) is accounted per client with opacus's RDP accountant: Poisson batches of rate
``q = batch_size / n_i`` and one noisy step each.
"""

from __future__ import annotations

import functools

ORDERS = (1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 14.0, 16.0, 20.0, 24.0,
          28.0, 32.0, 40.0, 48.0, 56.0, 64.0, 80.0, 96.0, 128.0)
"""Rényi orders of the central accountant: dp_accounting's default list stops at 1024, and its without-replacement
bound costs O(order²) per order (seconds per ε); orders above 128 only matter for ε well below 0.1."""


def resolved(accounting: str, num_clients: int, sample_size: int) -> str:
    """``privacy.accounting`` with ``auto`` resolved."""
    if accounting == "auto":
        return "no_amplification" if sample_size == num_clients else "without_replacement"
    return accounting


def central_event(accounting: str, noise_multiplier: float, num_clients: int, sample_size: int):
    """The ``dp_accounting`` event of one round of client-level DP."""
    from dp_accounting import dp_event

    if accounting == "without_replacement":
        return dp_event.SampledWithoutReplacementDpEvent(num_clients, sample_size,
                                                         dp_event.GaussianDpEvent(noise_multiplier / 2))
    return dp_event.GaussianDpEvent(noise_multiplier)


def central_accountant(accounting: str):
    """A fresh RDP accountant with the neighbouring relation ``accounting`` assumes."""
    from dp_accounting import privacy_accountant
    from dp_accounting.rdp import rdp_privacy_accountant

    relation = privacy_accountant.NeighboringRelation
    replace_one = accounting == "without_replacement"
    return rdp_privacy_accountant.RdpAccountant(
        orders=list(ORDERS), neighboring_relation=relation.REPLACE_ONE if replace_one else relation.ADD_OR_REMOVE_ONE)


def central_epsilon(accounting: str, noise_multiplier: float, num_clients: int, sample_size: int, rounds: int,
                    delta: float) -> float:
    """ε at ``delta`` after ``rounds`` releases (0 before the first)."""
    if rounds <= 0:
        return 0.0
    acc = central_accountant(accounting)
    acc.compose(central_event(accounting, noise_multiplier, num_clients, sample_size), rounds)
    return float(acc.get_epsilon(delta))


def central_noise_multiplier(accounting: str, target_epsilon: float, delta: float, num_clients: int,
                             sample_size: int, rounds: int) -> float:
    """The smallest noise multiplier whose ε after ``rounds`` releases is at most ``target_epsilon``."""
    from dp_accounting import dp_event, mechanism_calibration

    def event(z: float):
        return dp_event.SelfComposedDpEvent(central_event(accounting, z, num_clients, sample_size), rounds)

    z = mechanism_calibration.calibrate_dp_mechanism(
        lambda: central_accountant(accounting), event, target_epsilon, delta,
        bracket_interval=mechanism_calibration.LowerEndpointAndGuess(1e-3, 1.0), tol=1e-6)
    while central_epsilon(accounting, z, num_clients, sample_size, rounds, delta) > target_epsilon:
        z += 1e-6  # the search's tolerance, on the safe side
    return float(z)


def dp_sgd_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """A client's ε after ``steps`` DP-SGD steps on Poisson batches of rate ``sample_rate`` (opacus RDP).

    What ``opacus.accountants.RDPAccountant.get_epsilon`` gives for one ``(noise_multiplier, sample_rate, steps)``
    entry, bit for bit: its RDP is ``steps`` times one step's, and one step's (seconds of fractional-order series per
    call) is computed once per (noise multiplier, rate) and reused by every client and round."""
    if steps <= 0:
        return 0.0
    import numpy as np
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis import rdp

    step = np.array(_dp_sgd_step_rdp(noise_multiplier, min(1.0, sample_rate)))
    eps, _ = rdp.get_privacy_spent(orders=RDPAccountant.DEFAULT_ALPHAS, rdp=step * steps, delta=delta)
    return float(eps)


@functools.lru_cache(maxsize=1024)
def _dp_sgd_step_rdp(noise_multiplier: float, sample_rate: float) -> tuple[float, ...]:
    """One DP-SGD step's RDP at opacus's default orders (a tuple: cached values must not be mutable)."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis import rdp

    return tuple(rdp.compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1,
                                 orders=RDPAccountant.DEFAULT_ALPHAS).tolist())


def dp_sgd_noise_multiplier(target_epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """opacus's noise multiplier for ``steps`` steps at ``sample_rate`` within ``(target_epsilon, delta)``."""
    from opacus.accountants.utils import get_noise_multiplier

    return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta,
                                      sample_rate=min(1.0, sample_rate), steps=steps, accountant="rdp",
                                      epsilon_tolerance=0.005))
