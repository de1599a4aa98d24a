"""Models: loading (preset, hub id, local dir, GGUF), info and meta builds without weights, state and low-rank maths."""

from fedllm.common.lazy import lazy_attributes

__getattr__ = lazy_attributes(__name__, {name: "fedllm.models.loading" for name in (
    "load_model", "load_base_model", "load_tokenizer")})

__all__ = ["load_base_model", "load_model", "load_tokenizer"]
