"""The task interface: every registered evaluation task is a :class:`Task` subclass."""

from __future__ import annotations

import abc
from typing import Optional

from fedllm.evaluation.context import EvalContext
from fedllm.evaluation.sources import DataSourceError, HubSource, read_hub, read_records


class Task(abc.ABC):
    """One evaluation task (registered with :func:`fedllm.common.registry.register_task`).

    Attributes:
        name: registry name; metric keys are ``<name>/<metric>``.
        hub: default data on the hub, or None when the data must be given.
        uses_records: the held-out training records are used when no data spec is given.
    """

    name: str = ""
    hub: Optional[HubSource] = None
    uses_records: bool = False

    @abc.abstractmethod
    def run(self, ctx: EvalContext) -> dict[str, float]:
        """Evaluate ``ctx.model``; write the result file; return the task's metrics (unprefixed)."""

    def protocol(self, ctx: EvalContext) -> Optional[str]:
        """The scoring protocol in force, recorded in ``summary.json`` (None: the task has one way)."""
        return None

    def raw_records(self, ctx: EvalContext) -> list[dict]:
        """The task's raw records: ``eval.data[name]``, else held-out training records, else the hub default.

        Raises:
            DataSourceError: none of them is available.
        """
        spec = ctx.data_spec(self.name)
        if spec:
            return read_records(spec, self.hub.split if self.hub else "test")
        if self.uses_records and ctx.records:
            return list(ctx.records)
        if self.hub is None:
            raise DataSourceError(f"task {self.name!r} has no default data: pass --data {self.name}=PATH_OR_HUB_ID "
                                  f"(eval.data.{self.name})")
        return read_hub(self.hub)
