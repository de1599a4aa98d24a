"""Whether ``train.compile`` will pay for itself over a run's rounds, estimated from the recipe and the model's config.

Compiling is paid once per process (and inductor cache); it then saves part of every step. The figures are
docs/performance.md's, measured on the quickstart (SmolLM2-135M, 2 clients x 6 steps of 4 x 96 a round, idle
2-core machine): compiling with a cold inductor cache costs about 35 CPU-s more (about 6 with a warm one), and a
compiled round takes about 3 CPU-s less than an eager one, so compiling pays back after about **12 rounds** of
the quickstart's size in CPU time (22 in wall time). A busy machine pays far more: on a 2-core machine shared with
other jobs, the first round of the tiny recipe compiled for 1,325 s (issue 52).

A round's saving grows with the work of a round: the tokens its client steps train (clients x steps x batch x
grad_accum x max_length, an upper bound) times the parameters of the decoder's linear layers (what the compiled
layers multiply). So the break-even of a recipe is the quickstart's 12 rounds divided by the ratio of its round's
work to the quickstart's. Imports no torch: ``--dry-run`` and ``fedllm train`` say it before the model loads.
"""

from __future__ import annotations

from typing import Any, Optional

COLD_COMPILE_CPU_S = 35.0
"""Compiling the quickstart's layers with a cold inductor cache, CPU-seconds (docs/performance.md)."""
WARM_COMPILE_CPU_S = 6.0
"""The same from a warm inductor cache."""
QUICKSTART_BREAK_EVEN_ROUNDS = 12
"""Rounds of the quickstart's size after which a cold compile has paid for itself in CPU time."""
QUICKSTART_TOKENS_PER_ROUND = 2 * 6 * 4 * 96
"""Tokens a quickstart round trains at most: 2 clients x 6 steps x batch 4 x max_length 96."""
QUICKSTART_LINEAR_PARAMETERS = 30 * (2 * 576 * 576 + 2 * 192 * 576 + 3 * 1536 * 576)
"""SmolLM2-135M's decoder linear layers: 30 layers of q, o (576 x 576), k, v (192 x 576), gate, up, down (1536 x 576)."""


def linear_parameters(model: Any) -> Optional[int]:
    """Parameters of the decoder's linear layers of the recipe's ``model`` section, from its config; None if unknown."""
    from fedllm.models.info import layer_shapes, model_config

    config = model_config(model)
    layers = (config or {}).get("num_hidden_layers")
    shapes = layer_shapes(config) if config else {}
    if not isinstance(layers, int) or not shapes:
        return None
    return layers * sum(out * inp for out, inp in shapes.values())


def break_even_rounds(recipe: Any) -> Optional[float]:
    """Rounds after which compiling (cold cache) has saved what it cost, in CPU time; None when the recipe does not
    tell (local_epochs: the steps depend on the data; a model whose config is unknown here)."""
    tr = recipe.train
    params = linear_parameters(recipe.model)
    if params is None or tr.local_steps is None:
        return None
    tokens = recipe.sampled_per_round() * tr.local_steps * tr.batch_size * tr.grad_accum * tr.max_length
    work = tokens * params / (QUICKSTART_TOKENS_PER_ROUND * QUICKSTART_LINEAR_PARAMETERS)
    return QUICKSTART_BREAK_EVEN_ROUNDS / work


def compile_warning(recipe: Any) -> Optional[str]:
    """A warning when ``train.compile`` is on and will not pay for itself over the run's rounds; None otherwise."""
    if not recipe.train.compile:
        return None
    rounds = break_even_rounds(recipe)
    if rounds is None or rounds <= recipe.federation.rounds:
        return None
    return (f"train.compile: compiling costs about {COLD_COMPILE_CPU_S:.0f} CPU-s with a cold inductor cache "
            f"(about {WARM_COMPILE_CPU_S:.0f} warm) on an idle 2-core machine, and many minutes on a busy one; this "
            f"recipe's rounds would pay it back after about {rounds:,.0f} rounds, and the run has "
            f"{recipe.federation.rounds}: unless inductor's cache already holds these graphs, train.compile=false is "
            "likely faster (docs/performance.md, \"fedllm's compiled path on the quickstart\")")
