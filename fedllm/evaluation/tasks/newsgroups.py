"""20 Newsgroups (Lang, 1995): 20-way topic classification on the test set, accuracy.

Data: ``eval.data.20ng`` (file or hub id with ``text`` and ``label``), else the
held-out tokenized training examples, else ``SetFit/20_newsgroups`` (test split).
"""

from __future__ import annotations

from fedllm.common.registry import register_task
from fedllm.evaluation.classification_task import ClassificationTask
from fedllm.evaluation.sources import HubSource


@register_task("20ng")
class Newsgroups20(ClassificationTask):
    """20 Newsgroups accuracy."""

    name = "20ng"
    hub = HubSource("SetFit/20_newsgroups", None, "test")
    text_fields = ("text",)
