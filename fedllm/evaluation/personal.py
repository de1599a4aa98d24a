"""Summaries of personalized evaluation: each client's model on its own held-out split."""

from __future__ import annotations

from typing import Any, Optional


def personal_stats(per_client: dict[str, dict[str, float]]) -> dict[str, dict[str, Any]]:
    """``{metric: {"mean", "min", "max", "argmin", "argmax", "clients"}}`` over the clients that report it.

    Args:
        per_client: ``{client id: {metric: value}}`` (the ``personal_eval`` of a round record).

    Returns:
        Per metric the unweighted mean over clients, the worst and best client's value and id, and
        how many clients reported it.
    """
    values: dict[str, list[tuple[float, str]]] = {}
    for cid, metrics in per_client.items():
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values.setdefault(key, []).append((float(value), cid))
    out: dict[str, dict[str, Any]] = {}
    for key, pairs in sorted(values.items()):
        lo, hi = min(pairs), max(pairs)
        out[key] = {"mean": sum(v for v, _ in pairs) / len(pairs), "min": lo[0], "max": hi[0],
                    "argmin": lo[1], "argmax": hi[1], "clients": len(pairs)}
    return out


def client_choice(text: str) -> "int | str":
    """``--client`` of ``fedllm eval``: a client id or ``all``."""
    import argparse

    if text == "all":
        return text
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a client id or 'all', got {text!r}")


def evaluate_clients(checkpoint: str, client: "int | str", eval_cfg: Any, out_dir: Any, dtype: str = "fp32",
                     prompt_style: Optional[str] = None, progress: bool = True) -> dict[str, dict[str, float]]:
    """Each requested client's personal model on its own held-out split (``fedllm eval --client ID|all``).

    The split is the one the run held out for that client (``data.client_eval_fraction``), rebuilt from
    the checkpoint's recipe; a run without personal splits evaluates every client on the run's
    held-out data (or the tasks' own data).

    Raises:
        InputError: the run's strategy is not personalized, or the client id is out of range.
    """
    from pathlib import Path

    from fedllm.common.errors import InputError
    from fedllm.evaluation.runner import evaluate
    from fedllm.export.inference import model_from_checkpoint
    from fedllm.models.loading import read_state, write_state
    from fedllm.runs import checkpoint as ckpt_io

    model, tokenizer, strategy, recipe = model_from_checkpoint(checkpoint, dtype)
    name, n = recipe.federation.strategy, recipe.federation.num_clients
    if not strategy.personalized:
        raise InputError(f"--client {client}: strategy {name!r} of {checkpoint} is not personalized; "
                         "it has only the global model")
    if client != "all" and not 0 <= int(client) < n:
        raise InputError(f"--client {client}: the run has clients 0..{n - 1}")
    ids = list(range(n)) if client == "all" else [int(client)]
    store = ckpt_io.client_store(ckpt_io.load_checkpoint(ckpt_io.resolve_checkpoint(Path(checkpoint))))
    records, examples = _client_splits(recipe, tokenizer, model)
    out: dict[str, dict[str, float]] = {}
    for cid in ids:
        personal = strategy.personal_state(cid, store.get(cid))
        saved = read_state(model, personal.keys())
        write_state(model, personal)
        try:
            out[str(cid)] = evaluate(model, tokenizer, eval_cfg, out_dir, records=records(cid),
                                     eval_examples=examples(cid), tag=f"client-{cid}", prompt_style=prompt_style,
                                     progress=progress)
        finally:
            write_state(model, saved)
    return out


def _client_splits(recipe: Any, tokenizer: Any, model: Any):
    """``(records(cid), examples(cid))``: a client's held-out raw records and tokenized examples."""
    if recipe.data.client_eval_fraction > 0:
        from fedllm.data import build_federated_data
        from fedllm.models.loading import resolve_task

        data = build_federated_data(recipe.data, recipe.federation.partition, recipe.federation.num_clients,
                                    tokenizer, recipe.train.max_length, recipe.seed, resolve_task(recipe.model))
        return (lambda c: data.client_eval_records[c]), (lambda c: data.client_eval[c])
    from fedllm.commands.evaluate import heldout_records

    held = heldout_records(recipe)
    return (lambda c: held), (lambda c: None)
