"""Logging and third-party noise: quiet by default, everything with ``--verbose`` or ``FEDLLM_LOG=debug``.

Quiet mode filters what says nothing to a fedllm user: transformers' advisory and
deprecation chatter (``TRANSFORMERS_VERBOSITY=error``, and their FutureWarnings), the ``is_gradient_checkpointing``
FutureWarning, bitsandbytes' optional-kernel warnings and those of the ``kernels`` package it asks for (and
``fedllm train`` does not let peft import bitsandbytes at all unless the recipe quantises) and huggingface_hub's retry
warnings (offline runs fail at once instead, see :mod:`fedllm.models.hub`). fedllm's own
warnings and errors always show.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

#: (warning category, message regex) filtered in quiet mode.
NOISY_WARNINGS = (
    (FutureWarning, r".*is_gradient_checkpointing"),
    (FutureWarning, r".*`resume_download` is deprecated"),
    (UserWarning, r".*TypedStorage is deprecated"),
)
#: Modules whose FutureWarnings (deprecations inside the library, nothing a fedllm user can act on) are
#: filtered in quiet mode.
NOISY_DEPRECATIONS = (r"transformers(\.|$)", r"peft(\.|$)", r"accelerate(\.|$)")
#: Third-party loggers lowered to ERROR in quiet mode.
NOISY_LOGGERS = ("bitsandbytes", "kernels", "huggingface_hub.utils._http", "huggingface_hub.file_download",
                 "accelerate")
_quiet = False  # set by configure(); the Python API (no configure) changes nothing


def configure(verbose: bool = False) -> bool:
    """Set up logging for a command; returns whether the run is verbose (flag or ``FEDLLM_LOG=debug``)."""
    level = os.environ.get("FEDLLM_LOG", "").upper() or ("DEBUG" if verbose else "WARNING")
    global _quiet
    verbose = verbose or level == "DEBUG"
    _quiet = not verbose
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("fedllm").setLevel(level)
    if verbose:
        return True
    quiet_third_party()
    return False


def quiet_third_party() -> None:
    """Filter what says nothing to a fedllm user (the lists above): the quiet mode of every fedllm process, the
    CLI's and the Flower runtime's (whose fedllm logger stays at INFO)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("WANDB_SILENT", "true")
    for category, message in NOISY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for module in NOISY_DEPRECATIONS:  # their own deprecation notices, about their own internals
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def block_bitsandbytes() -> bool:
    """Make ``import bitsandbytes`` fail (peft imports it eagerly, and its CPU backend warns) until
    :func:`unblock_bitsandbytes`; returns False, doing nothing, when it is imported already."""
    if "bitsandbytes" in sys.modules:
        return False
    sys.modules["bitsandbytes"] = None  # type: ignore[assignment]  (the import system's "not importable")
    return True


def unblock_bitsandbytes() -> None:
    """Undo :func:`block_bitsandbytes` (a quantised recipe imports it when it loads the model)."""
    if "bitsandbytes" in sys.modules and sys.modules["bitsandbytes"] is None:
        del sys.modules["bitsandbytes"]


def quiet_loading_bars() -> None:
    """In quiet mode, no per-load or per-save bars from transformers ("Loading weights", "Converting and
    de-quantizing GGUF tensors", "Writing model shards"); download bars of the hub client stay."""
    if not _quiet:
        return
    import importlib
    from functools import partial

    from tqdm.auto import tqdm

    for name in ("transformers.modeling_gguf_pytorch_utils", "transformers.core_model_loading"):
        try:
            module = importlib.import_module(name)
        except ImportError:  # another transformers version: nothing to quiet there
            continue
        if hasattr(module, "tqdm"):
            module.tqdm = partial(tqdm, disable=True)
    from transformers.utils import logging as hf_logging  # save_pretrained's "Writing model shards"

    hf_logging.tqdm = partial(tqdm, disable=True)
