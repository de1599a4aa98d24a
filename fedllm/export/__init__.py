"""A trained run as a model: rebuilt for use (``inference``), or exported as a merged model or PEFT adapter.

``fedllm export`` writes merged models and PEFT adapters that load without fedllm.

- ``merged``: a transformers model directory (safetensors + config + tokenizer) whose weights
  hold everything the run learned: LoRA, FRLoRA's merged residuals, FedLoRU's kept factors,
  the trained classifier head.
- ``adapter``: a PEFT LoRA directory for ``PeftModel.from_pretrained(original_base, DIR)``,
  exact (stacked or SVD at numerical rank) or truncated to ``--rank`` with its error reported.

Every export carries a model card (README.md) and ``export.json``; it is written into a
temporary directory beside ``--out`` and renamed at the end, so a failure leaves nothing.
"""

from fedllm.common.lazy import lazy_attributes
from fedllm.export.errors import ExportCheckError, ExportInputError
from fedllm.export.formats import FORMATS

__getattr__ = lazy_attributes(__name__, {name: "fedllm.export.api" for name in ("ExportResult", "export",
                                                                                 "export_command")})

__all__ = ["FORMATS", "ExportCheckError", "ExportInputError", "ExportResult", "export", "export_command"]
