"""GGUF models converted once: the dequantised weights and the tokenizer kept in fedllm's cache.

transformers converts a GGUF file at every load: it parses the metadata (the whole vocabulary), dequantises
every tensor and builds the tokenizer — about 20 s for SmolLM2-135M on one core of a small machine, longer for
Gemma 3 270M's 262k vocabulary — on every ``train``, ``eval``, ``export`` and ``serve``. The first fp32 load
keeps what it converted under ``$FEDLLM_CACHE_DIR/models/converted/<file stem>-<key>/`` (default
``~/.cache/fedllm``): ``tokenizer/`` and ``model/`` (config, generation config, fp32 safetensors). Later loads
read them in about a second, with the same tensors bit for bit. The key covers the GGUF's resolved path, size
and modification time and the transformers version, so a changed file or converter is converted again.

transformers refuses to ``save_pretrained`` a GGUF-loaded model (its GGUF "quantizer" is not serialisable), so
the weights are written with safetensors' ``save_model``, which keeps tied tensors once.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Optional


def converted_dir(directory: str, gguf_file: str) -> Path:
    """Where the conversion of ``directory/gguf_file`` is kept."""
    import transformers

    from fedllm.models.chunked_weights import models_cache_dir

    path = (Path(directory) / gguf_file).resolve()
    stat = path.stat()
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|transformers {transformers.__version__}"
    return models_cache_dir() / "converted" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def tokenizer_dir(directory: str, gguf_file: str) -> Optional[str]:
    """The kept tokenizer of this GGUF, or None when it was not converted yet."""
    saved = converted_dir(directory, gguf_file) / "tokenizer"
    return str(saved) if (saved / "tokenizer_config.json").is_file() else None


def model_dir(directory: str, gguf_file: str) -> Optional[str]:
    """The kept fp32 model of this GGUF, or None when it was not converted yet."""
    saved = converted_dir(directory, gguf_file) / "model"
    return str(saved) if (saved / "model.safetensors").is_file() else None


def keep_tokenizer(tokenizer: Any, directory: str, gguf_file: str) -> None:
    """Keep a tokenizer just converted from ``directory/gguf_file`` (first writer wins; failures are ignored)."""
    _write_once(converted_dir(directory, gguf_file) / "tokenizer", tokenizer.save_pretrained)


def keep_model(model: Any, directory: str, gguf_file: str) -> None:
    """Keep an fp32 model just converted from ``directory/gguf_file`` (first writer wins; failures are ignored)."""
    _write_once(converted_dir(directory, gguf_file) / "model", lambda target: write_model(model, target))


def write_model(model: Any, target: str) -> None:
    """Write a model converted from a GGUF file into the directory ``target`` as :func:`keep_model` keeps it."""
    from safetensors.torch import save_model

    model.config.save_pretrained(target)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(target)
    save_model(model, str(Path(target) / "model.safetensors"), metadata={"format": "pt"})


@contextlib.contextmanager
def tensor_name_maps_once() -> Iterator[None]:
    """While a GGUF is converted: gguf's ``get_tensor_name_map`` built once per (architecture, layer count).

    transformers' ``get_gguf_hf_weights_map`` walks every submodule and rebuilds gguf's ``TensorNameMap`` (a
    dictionary of every known tensor name) for each: 397 times for SmolLM2-135M, about a third of its conversion
    (docs/performance.md). The map is a pure function of its arguments and is only read, so one per key is kept
    for the duration; the function is restored afterwards. Without the ``gguf`` package, nothing is changed.
    """
    try:
        import gguf
    except ImportError:
        yield
        return
    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


_parsed: dict[tuple, Any] = {}
"""The GGUF files parsed inside the open :func:`one_parse_per_file` scopes (key: path, size, mtime)."""
_scopes = 0


@contextlib.contextmanager
def one_parse_per_file() -> Iterator[None]:
    """While open: each GGUF file's metadata parsed once, however many times transformers reads the file.

    transformers reads a GGUF three times on a first load: for the tokenizer, for the config and for the weights,
    and each read parses the whole metadata again with gguf's ``GGUFReader`` (the vocabulary, one field part per
    token: Gemma 3 270M's 262k tokens cost 14.8 CPU-s and 669 MB a parse on this machine, SmolLM2's 49k 4.1 s and
    158 MB; ``python bench/gguf_one_parse.py``). Inside the scope the first parse of a file is kept and handed to
    the later reads; nothing reads a reader but to copy values out of it, so they see the same fields and tensors.
    Scopes nest; the parses are dropped when the outermost one closes. Without the ``gguf`` package, nothing is
    changed."""
    global _scopes
    try:
        import gguf
    except ImportError:
        yield
        return
    original = gguf.GGUFReader if _scopes == 0 else None

    def reader(path, *args, **kwargs):
        stat = Path(path).stat()
        key = (str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns, args, tuple(sorted(kwargs.items())))
        if key not in _parsed:
            _parsed[key] = original(path, *args, **kwargs)
        return _parsed[key]

    if original is not None:
        gguf.GGUFReader = reader
    _scopes += 1
    try:
        yield
    finally:
        _scopes -= 1
        if original is not None:
            gguf.GGUFReader = original
            _parsed.clear()


def _write_once(target: Path, write: Callable[[str], None]) -> None:
    """``write`` into a temporary directory beside ``target``, renamed into place unless another process was first.

    The cache only saves time: a full disk or a concurrent writer leaves the conversion uncached, never an error.
    """
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    except OSError:
        return
    try:  # kept by another process meanwhile, or no space: the GGUF is converted again next time
        with contextlib.suppress(OSError):
            write(str(tmp))
            tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
