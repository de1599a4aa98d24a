"""What a client's training statistics release when a privacy mechanism is on (``privacy.per_client_stats``).

Under secure aggregation the server learns only the sum of the uploads, and under client-level DP (``central``,
``central_client_clipping``) only a noised mean is released; a client's training loss, its token counts and its
padding beside them are functions of its data that nothing protects. Unless the recipe opts in
(``privacy.per_client_stats: true``), a client withholds them (:func:`withhold`: on the node before a Flower
reply, and in the masked upload of SecAgg+ in every transport), and a round's ``metrics.jsonl`` line holds only
totals (:func:`round_entries`): no ``train_loss``, ``client_loss``, per-client ``client_steps``, ``bytes_up`` /
``bytes_down`` or protocol bytes, no ``throughput`` or ``padded_fraction`` (sums of the clients' token counts, which
the server could only add up from the parts). DP-SGD's loss is withheld as before
(:meth:`fedllm.privacy.dp_sgd.SampleLevelDP.released_loss`); its per-client steps stay (its ε is per client).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fedllm.privacy.secagg.settings import enabled as secure_aggregation


def withheld(recipe: Any) -> bool:
    """True when the recipe's privacy mechanism keeps per-client statistics from the server."""
    pv = recipe.privacy
    client_level = pv.mechanism in ("central", "central_client_clipping")
    return not pv.per_client_stats and (secure_aggregation(pv) or client_level)


def withhold(update: Any) -> Any:
    """``update`` without its data-dependent statistics: no loss, no work counts (tokens, seconds), no padding."""
    return dataclasses.replace(update, loss=None, work={}, padding=(0, 0))


def round_entries(record: dict[str, Any]) -> dict[str, Any]:
    """A round's metrics record with each per-client entry replaced by its total (``bytes_up_total`` and
    ``bytes_down_total`` are there already; ``steps_total``, ``protocol_bytes_up_total``)."""
    out = {k: v for k, v in record.items()
           if k not in ("client_loss", "train_loss", "bytes_up", "bytes_down", "throughput", "padded_fraction")}
    steps = out.pop("client_steps", None)
    if steps is not None:
        out["steps_total"] = sum(steps.values())
    secure = out.get("secure_aggregation")
    if secure and "protocol_bytes_up" in secure:
        secure = dict(secure)
        secure["protocol_bytes_up_total"] = sum(secure.pop("protocol_bytes_up").values())
        out["secure_aggregation"] = secure
    return out
