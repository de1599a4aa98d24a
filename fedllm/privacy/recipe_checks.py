"""Recipe validation of the ``privacy`` section (no torch import: runs at recipe load).

Client-level DP clips each client's update and adds Gaussian noise to their *sum*: the guarantee holds only
for a strategy whose server step is a mean of the clients' uploads, each upload the client's starting
state plus its (clipped) change, with anything after it a function of that noised mean. The built-in
strategies that are such are listed in :data:`SUMMED_DELTA_STRATEGIES`; the others are refused with the
reason in :data:`REFUSED`. A strategy registered elsewhere is refused until it is added here.
"""

from __future__ import annotations

from typing import Any

SUMMED_DELTA_STRATEGIES = frozenset({
    "fedavg", "fedprox", "fedavgm", "fedadagrad", "fedyogi", "fedadam", "ffa_lora", "fedsa_lora", "frlora",
    "fedsvd", "fed_sb", "frlora_v1", "frlora_v2", "frlora_v3", "fedloru", "pfedloru", "fedlora_pfl", "rolora"})
"""Strategies whose aggregate is a mean of uploads that are ``sent state + change`` (then post-processing)."""

_ROBUST = ("selects or ranks individual uploads (median, trimmed mean, Krum scores), so the aggregate is not a "
           "noised sum and the Gaussian mechanism's guarantee does not apply")
REFUSED = {
    "scaffold": "uploads control-variate corrections beside the model, which are not a change of the sent state",
    "flexlora": "averages each client's full product s·B_k·A_k, a nonlinear function of one client's upload, not "
                "a sum of clipped uploads",
    "flora": "stacks the clients' adapters instead of summing them",
    "fedex_lora": "adds the mean of each client's own product s·B_k·A_k to the base: not a sum of clipped uploads",
    "mfedloru": "rebuilds each client's factors from nested products before averaging: not a sum of clipped uploads",
    "pflmf": "uploads gradients taken at each client's private vector, not a change of the sent state",
    "local": "aggregates nothing",
    "hetlora": "weights each client's upload by its own norm ||B_k·A_k||_F, a nonlinear function of that upload, "
               "and clients prune their ranks on their data: not a fixed-weight sum of clipped uploads",
    "lora_fair": "refines B̄ toward Σ_k p_k·B_k·A_k, the mean of each client's own product (nonlinear in one "
                 "client's upload): not a sum of clipped uploads",
    "fedmedian": _ROBUST, "fedtrimmedavg": _ROBUST, "krum": _ROBUST, "multikrum": _ROBUST, "bulyan": _ROBUST,
    "bulyan_multikrum": _ROBUST,
}

DP_SGD_REFUSED = {
    "fedprox": "adds a proximal loss term whose gradient is not per-example, which DP-SGD's per-example "
               "clipping would drop",
}

SECAGG_MECHANISMS = ("none", "central_client_clipping", "dp_sgd")
"""Mechanisms that work on a sum: the server adds noise to the unmasked sum (clients clip) or adds nothing."""


def secure_aggregation_problems(r: Any) -> list[tuple[str, Any, str]]:
    """Problems of ``privacy.secure_aggregation: secagg_plus`` and its ``privacy.secagg`` parameters (the
    strategy's own check, :meth:`fedllm.strategies.Strategy.sum_aggregation_problem`, is in recipe.checks)."""
    pv, p = r.privacy, []
    if pv.secure_aggregation != "secagg_plus":
        return p
    from fedllm.privacy.secagg.settings import round_params

    if pv.mechanism not in SECAGG_MECHANISMS:
        p.append(("privacy.mechanism", pv.mechanism, ("central_client_clipping (clients clip, the server noises the "
                                                      "unmasked sum), dp_sgd or none with secure aggregation: "
                                                      "server-side clipping needs each client's update, which the "
                                                      "server never sees")))
    if r.federation.max_update_norm is not None:
        p.append(("federation.max_update_norm", r.federation.max_update_norm,
                  "null with secure aggregation (the server sees no client's update, only their sum)"))
    cfg = pv.secagg
    for key in ("neighbours", "max_dropouts", "quantization_bits"):
        if getattr(cfg, key) < 0:
            p.append((f"privacy.secagg.{key}", getattr(cfg, key), "a number >= 0"))
    if p:
        return p
    m = r.sampled_per_round()
    for key, what in round_params(cfg, m).problems(m):
        key = "federation.clients_per_round" if key == "clients" else f"privacy.secagg.{key}"
        given = m if key.startswith("federation") else getattr(cfg, key.rsplit(".", 1)[1])
        what = what.rsplit(", got", 1)[0] if given is not None else what  # the default's value stays named
        p.append((key, given, f"{what} (with {m} clients per round; sample more clients or allow fewer "
                              "privacy.secagg.max_dropouts)" if key.endswith("threshold") else what))
    return p


def strategy_problem(mechanism: str, strategy: str) -> str | None:
    """Why ``strategy`` cannot run under ``privacy.mechanism: mechanism`` (None when it can)."""
    if strategy in REFUSED:
        return REFUSED[strategy]
    if strategy not in SUMMED_DELTA_STRATEGIES:
        return ("not declared as uploading a summed model delta (add it to "
                "fedllm.privacy.recipe_checks.SUMMED_DELTA_STRATEGIES once it is)")
    if mechanism == "dp_sgd" and strategy in DP_SGD_REFUSED:
        return DP_SGD_REFUSED[strategy]
    return None


def privacy_problems(r: Any) -> list[tuple[str, Any, str]]:
    """Problems of ``r.privacy`` as ``(key, given, expected)``."""
    pv, p = r.privacy, []
    p.extend(secure_aggregation_problems(r))
    if pv.grad_sample_mode != "hooks" and pv.mechanism != "dp_sgd":
        p.append(("privacy.grad_sample_mode", pv.grad_sample_mode, "hooks unless privacy.mechanism is dp_sgd (it picks "
                                                                   "how DP-SGD clips each example's gradient)"))
    if pv.mechanism == "none":
        for key in ("noise_multiplier", "target_epsilon"):
            if getattr(pv, key) is not None:
                p.append((f"privacy.{key}", getattr(pv, key), "null when privacy.mechanism is none (or choose a "
                                                              "mechanism: central, central_client_clipping, dp_sgd)"))
        if pv.adaptive_clipping.enabled:
            p.append(("privacy.adaptive_clipping.enabled", True, "false when privacy.mechanism is none"))
        return p
    why = strategy_problem(pv.mechanism, r.federation.strategy)
    if why:
        p.append(("privacy.mechanism", pv.mechanism, f"none with federation.strategy {r.federation.strategy!r}: "
                                                     f"it {why}"))
    if r.federation.strategy == "fed_sb" and r.federation.strategy_args.get("init", "gradient") == "gradient":
        p.append(("federation.strategy_args.init", "gradient", (
            f"weights with privacy.mechanism {pv.mechanism}: the gradient init reads training examples once outside "
            "the DP mechanism (its ε would not cover them)")))
    if pv.mechanism != "dp_sgd" and r.federation.min_clients_per_round > 1:
        p.append(("federation.min_clients_per_round", r.federation.min_clients_per_round,
                  f"1 with privacy.mechanism {pv.mechanism}: whether a round is released would depend on how many of "
                  "the other sampled clients' updates were valid (the noised sum has a fixed denominator and needs "
                  "no minimum; a round is not retried under client-level DP)"))
    if pv.noise_multiplier is None and pv.target_epsilon is None:
        p.append(("privacy.noise_multiplier", None, "a positive number, or give privacy.target_epsilon"))
    if pv.noise_multiplier is not None and not pv.noise_multiplier > 0:
        p.append(("privacy.noise_multiplier", pv.noise_multiplier, "a positive number"))
    if pv.target_epsilon is not None and not pv.target_epsilon > 0:
        p.append(("privacy.target_epsilon", pv.target_epsilon, "a positive number"))
    if not pv.clipping_norm > 0:
        p.append(("privacy.clipping_norm", pv.clipping_norm, "a positive number"))
    if pv.accounting == "no_amplification" and r.sampled_per_round() < r.federation.num_clients:
        p.append(("privacy.accounting", pv.accounting, "auto or without_replacement when not every client trains every "
                                                       "round (one client's update can displace another's)"))
    if not 0 < pv.delta < 1:
        p.append(("privacy.delta", pv.delta, "a number in (0, 1), well below 1 / number of clients"))
    ac = pv.adaptive_clipping
    if ac.enabled:
        if pv.mechanism == "dp_sgd":
            p.append(("privacy.adaptive_clipping.enabled", True, "false with privacy.mechanism dp_sgd (per-example "
                                                                  "clipping is fixed)"))
        if not 0 <= ac.target_quantile <= 1:
            p.append(("privacy.adaptive_clipping.target_quantile", ac.target_quantile, "a number in [0, 1]"))
        if not ac.learning_rate > 0:
            p.append(("privacy.adaptive_clipping.learning_rate", ac.learning_rate, "a positive number"))
        stddev = ac.count_stddev if ac.count_stddev is not None else r.sampled_per_round() / 20
        if ac.count_stddev is not None and ac.count_stddev < 0:
            p.append(("privacy.adaptive_clipping.count_stddev", ac.count_stddev, "a number >= 0"))
        elif pv.noise_multiplier is not None and pv.noise_multiplier >= 2 * stddev:
            p.append(("privacy.adaptive_clipping.count_stddev", ac.count_stddev,
                      f"more than noise_multiplier / 2 = {pv.noise_multiplier / 2:g} (default: clients per round "
                      f"/ 20 = {r.sampled_per_round() / 20:g}); the count noise spends part of the budget"))
    if pv.mechanism == "dp_sgd":
        tr = r.train
        for key, ok, expected in (("grad_accum", tr.grad_accum == 1, "1 with DP-SGD (each step is one Poisson batch)"),
                                  ("clients_per_pass", tr.clients_per_pass == 1, "1 with DP-SGD"),
                                  ("dtype", tr.dtype != "fp16", "fp32 or bf16 with DP-SGD (no loss scaling)"),
                                  ("max_grad_norm", tr.max_grad_norm is None,
                                   "null with DP-SGD (privacy.clipping_norm clips each example's gradient)")):
            if not ok:
                p.append((f"train.{key}", getattr(tr, key), expected))
    return p
