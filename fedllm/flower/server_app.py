"""The Flower ServerApp: ``fedllm.engine.server.run`` on a recipe, its clients trained by SuperNodes.

Run config (``flwr run ... --run-config "recipe='/abs/recipe.yaml' ..."``; paths are read where the
SuperLink runs the ServerApp):

- ``recipe``: the YAML recipe (required); ``overrides``: dotted ``key=value`` pairs, space separated;
- ``resume``: continue the run in the recipe's ``output_dir`` from its newest checkpoint (a restarted server);
- ``overwrite``: replace an existing run; ``timeout``: seconds to wait for the nodes of a round;
- ``probe-mb``: send every node a tensor of that many MB at start and check it arrives whole;
- ``wait-nodes``: seconds to wait at start for one SuperNode per client (progress every 5 s), then fail.

Under ``fedllm flower superlink`` this app is run by fedllm's own runner (:mod:`fedllm.flower.runtime`), which
sets :data:`NODE_KEYS` to the directory of the clients' node keys (``fedllm flower certs``): client K is then
served only by the node that authenticated with ``client-K.pub``.
"""

from __future__ import annotations

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

app = ServerApp()
NODE_KEYS: str | None = None
"""Directory holding ``client-K.pub`` (OpenSSH) for every client K, or None (any node may claim a client)."""


def read_node_keys(directory: str) -> dict[int, bytes]:
    """Client id -> its node's public key (PEM), from ``client-K.pub`` files."""
    from pathlib import Path

    from cryptography.hazmat.primitives import serialization

    keys = {}
    for path in sorted(Path(directory).glob("client-*.pub")):
        key = serialization.load_ssh_public_key(path.read_bytes())
        keys[int(path.stem.split("-", 1)[1])] = key.public_bytes(serialization.Encoding.PEM,
                                                                 serialization.PublicFormat.SubjectPublicKeyInfo)
    return keys


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Build the federation from the recipe and run the round loop with a :class:`FlowerExecutor`."""
    from fedllm.engine.server import run
    from fedllm.flower.executor import FlowerExecutor
    from fedllm.recipe.checks import load_recipe

    cfg = context.run_config
    if not cfg.get("recipe"):
        raise ValueError("run config: key 'recipe' missing; expected the path of a recipe YAML, e.g. "
                         "--run-config \"recipe='/abs/path/recipe.yaml'\"")
    recipe = load_recipe(str(cfg["recipe"]), str(cfg.get("overrides", "")).split())
    executor = FlowerExecutor(grid, timeout=float(cfg.get("timeout", 3600)), probe_mb=float(cfg.get("probe-mb", 0)),
                              wait_nodes=float(cfg.get("wait-nodes", 120)),
                              node_keys=read_node_keys(NODE_KEYS) if NODE_KEYS else None)
    result = run(recipe, resume=bool(cfg.get("resume", False)), overwrite=bool(cfg.get("overwrite", False)),
                 progress=False, executor=executor)
    print(result.run_dir, flush=True)
