"""Import every module that registers something, so the registries are full."""

import fedllm.data.partition  # noqa: F401
import fedllm.evaluation  # noqa: F401
import fedllm.strategies  # noqa: F401
