"""GLUE RTE, CoLA and QNLI (Wang et al., 2019) on their validation sets, as in FRLoRA §4.1.

Accuracy for RTE and QNLI; Matthews correlation (and accuracy) for CoLA. Data:
``eval.data.<task>`` (file or hub id), else the held-out tokenized training
examples, else ``nyu-mll/glue`` (validation split).
"""

from __future__ import annotations

from fedllm.common.registry import register_task
from fedllm.evaluation.classification_task import ClassificationTask
from fedllm.evaluation.metrics import matthews_corrcoef
from fedllm.evaluation.sources import HubSource


@register_task("rte")
class RTE(ClassificationTask):
    """Recognising textual entailment (2 labels), accuracy."""

    name = "rte"
    hub = HubSource("nyu-mll/glue", "rte", "validation")
    text_fields = ("sentence1", "sentence2")


@register_task("cola")
class CoLA(ClassificationTask):
    """Linguistic acceptability (2 labels), Matthews correlation."""

    name = "cola"
    hub = HubSource("nyu-mll/glue", "cola", "validation")
    text_fields = ("sentence",)
    metrics = {**ClassificationTask.metrics, "mcc": matthews_corrcoef}


@register_task("qnli")
class QNLI(ClassificationTask):
    """Question-answering entailment (2 labels), accuracy."""

    name = "qnli"
    hub = HubSource("nyu-mll/glue", "qnli", "validation")
    text_fields = ("question", "sentence")
