"""What a SuperLink restarted on its ``--database`` finds: runs whose ServerApp died with the previous SuperLink.

Every ServerApp runs in a child of fedllm's ServerApp runner, which dies with ``fedllm flower superlink`` (even by
``kill -9``: :mod:`fedllm.flower.processes`). A run the database still lists as starting or running when the
SuperLink starts again has therefore lost its ServerApp: Flower would count it running until its task's heartbeat
lapsed (3 minutes under fedllm: :mod:`fedllm.flower.task_patience`), and a SuperNode that was pulling one of its
messages kept asking for objects nobody would push (2 min 13 s in an outside trial, while the resumed run waited for
that node). ``fedllm flower superlink`` stops such runs as it starts; a node's pull then fails at once (the SuperLink
refuses objects of a finished run) and the node takes the next run's messages.
"""

from __future__ import annotations

from datetime import UTC, datetime

ORPHAN_STATUSES = ("starting", "running")


def orphaned_runs(runs: list[dict], began: datetime) -> list[str]:
    """The ids of ``runs`` (``flwr ls --format json``'s) that started before ``began`` (this SuperLink's start) and
    are still starting or running; a run started since (claimed by this SuperLink's runner) is not one, nor a run whose
    start time cannot be read."""
    out = []
    for run in runs:
        status = str(run.get("status", "")).split(":")[0]
        stamp = str(run.get("running-at") or "") if status == "running" else ""
        stamp = stamp if stamp and stamp != "N/A" else str(run.get("starting-at") or "")
        try:
            at = datetime.fromisoformat(stamp)
        except ValueError:
            continue
        at = at if at.tzinfo else at.replace(tzinfo=UTC)
        if status in ORPHAN_STATUSES and at < began:
            out.append(str(run.get("run-id")))
    return out
