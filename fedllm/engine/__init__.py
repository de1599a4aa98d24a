"""The engine: THE round loop, local training of a client, client batching and faults, N-process simulation."""

from fedllm.common.lazy import lazy_attributes

__getattr__ = lazy_attributes(__name__, {"run": "fedllm.engine.server", "RunResult": "fedllm.engine.server"})

__all__ = ["RunResult", "run"]
