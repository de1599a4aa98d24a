"""fedllm on Flower's deployment engine: a ServerApp and a ClientApp built from a recipe.

- :mod:`fedllm.flower.server_app` / :mod:`fedllm.flower.client_app`: the apps (``app/pyproject.toml`` names them);
- :mod:`fedllm.flower.adapter`: the one adapter from fedllm's Strategy hooks to Flower's strategy interface;
- :mod:`fedllm.flower.executor`: the round loop's executor on Flower's grid;
- :mod:`fedllm.flower.node`: a SuperNode's client (its data, per-client state and catch-up);
- :mod:`fedllm.flower.records`: tensors <-> Flower records; :mod:`fedllm.commands.flower`: ``fedllm flower``.

Nothing here is imported by the rest of fedllm; it needs fedllm's ``flower`` extra (``pip install ".[flower]"`` in a clone; :func:`fedllm.common.errors.install_hint`).
"""

from pathlib import Path

APP_DIR = Path(__file__).parent / "app"
FEDERATION_INCOMPLETE = "federation incomplete"
"""Marks a ServerApp failure because too few SuperNodes came (``fedllm flower run`` then exits 2)."""
BAD_INPUT = "bad input"
"""Marks a ServerApp failure on bad input (a recipe the strategy refuses, a taken run directory: any
:class:`fedllm.common.errors.InputError`); ``fedllm flower run`` then exits 2, as ``fedllm train`` does."""
