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
served only by the node that authenticated with ``client-K.pub``; and :data:`OPERATOR`: a run's config must then be
signed with the operator's key (:mod:`fedllm.flower.authorise`; checked before any file is read) and its
``output_dir`` must lie inside the SuperLink's ``--runs-dir``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

app = ServerApp()
NODE_KEYS: str | None = None
"""Directory holding ``client-K.pub`` (OpenSSH) for every client K, or None (any node may claim a client)."""


@dataclass
class Operator:
    """What the SuperLink's operator allows (``fedllm flower superlink``)."""

    public_key: str | None  # the operator's Ed25519 public key; None: unsigned runs are accepted
    runs_dir: str  # a run's output_dir must lie inside it
    used_nonces: str  # the nonces of the signed configs run so far (a replay is refused)


OPERATOR: Operator | None = None
"""Set by fedllm's ServerApp runner; None (Flower's own runner): the run config is taken as given."""


def authorised_recipe(cfg: dict, operator: Operator):
    """The run's recipe, once the config is the operator's (signature, age, nonce, the recipe's bytes) and its
    ``output_dir`` lies inside ``operator.runs_dir``."""
    from fedllm.flower import authorise
    from fedllm.recipe.checks import load_recipe, recipe_from_bytes

    overrides = str(cfg.get("overrides", "")).split()
    if operator.public_key is not None:
        authorise.verify(cfg, Path(operator.public_key))
        authorise.claim_nonce(cfg, Path(operator.used_nonces))
        recipe = recipe_from_bytes(authorise.signed_recipe(cfg), str(cfg["recipe"]), overrides)
    else:
        recipe = load_recipe(str(cfg["recipe"]), overrides)
    out, allowed = Path(recipe.output_dir).expanduser().resolve(), Path(operator.runs_dir).resolve()
    if not out.is_relative_to(allowed):
        raise authorise.RunRefused(f"output_dir={recipe.output_dir}: outside {allowed}, the only directory runs of this "
                         "SuperLink may write to (fedllm flower superlink --runs-dir)")
    return recipe


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
    recipe = (authorised_recipe(cfg, OPERATOR) if OPERATOR is not None
              else load_recipe(str(cfg["recipe"]), str(cfg.get("overrides", "")).split()))
    executor = FlowerExecutor(grid, timeout=float(cfg.get("timeout", 3600)), probe_mb=float(cfg.get("probe-mb", 0)),
                              wait_nodes=float(cfg.get("wait-nodes", 120)),
                              node_keys=read_node_keys(NODE_KEYS) if NODE_KEYS else None)
    result = run(recipe, resume=bool(cfg.get("resume", False)), overwrite=bool(cfg.get("overwrite", False)),
                 progress=False, executor=executor)
    print(result.run_dir, flush=True)
