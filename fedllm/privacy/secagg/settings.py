"""A round's :class:`SecAggParams` from the recipe's ``privacy.secagg`` section (no torch: runs at recipe load)."""

from __future__ import annotations

from typing import Any

from fedllm.privacy.secagg.params import SecAggParams


def enabled(privacy: Any) -> bool:
    """True when the recipe's ``privacy.secure_aggregation`` is ``secagg_plus``."""
    return privacy.secure_aggregation == "secagg_plus"


def round_params(cfg: Any, clients: int, total_weight: int = 1) -> SecAggParams:
    """The parameters of a round of ``clients`` clients whose integer weights sum to at most ``total_weight``.

    The threshold defaults to the round's neighbours minus ``max_dropouts``; the words are 32 bits when the
    largest possible sum fits, else 64 (twice the bytes).
    """
    probe = SecAggParams(threshold=1, neighbours=cfg.neighbours, max_dropouts=cfg.max_dropouts)
    k = probe.effective_neighbours(clients)
    threshold = cfg.threshold if cfg.threshold is not None else k - cfg.max_dropouts
    params = SecAggParams(
        threshold, cfg.neighbours, float(cfg.quantization_range), cfg.quantization_bits, 32, cfg.max_dropouts
    )
    if not params.fits(max(total_weight, clients)):
        params = SecAggParams(
            threshold, cfg.neighbours, float(cfg.quantization_range), cfg.quantization_bits, 64, cfg.max_dropouts
        )
    return params
