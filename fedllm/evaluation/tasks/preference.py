"""``pref_accuracy``: how often the model prefers the chosen answer of held-out preference pairs.

On the held-out pairs of a ``data.format: preference`` run (``data.eval_fraction`` or ``data.eval_path``; a
personalized strategy's clients: their own split) it reports what trl logs for DPO (``rewards/accuracies``,
``rewards/margins``, ``rewards/chosen``, ``rewards/rejected``): the implicit reward of each answer under
``train.preference`` — ``β (log π(y) − log π_ref(y))``, SimPO: ``β log π(y) / |y|`` — and

* ``accuracy``: the fraction of pairs whose chosen answer has the higher reward (a tie counts as wrong, as in trl;
  the model training started from has every reward 0);
* ``margin``: the mean of chosen minus rejected reward; ``chosen_reward``, ``rejected_reward``: their means;
* ``logp_accuracy``: the fraction of pairs where the model itself gives the chosen answer the higher
  log-probability (no reference: meaningful before training too).

The reference log-probabilities are those the run computed once before round 1 (:mod:`fedllm.engine.reference`),
carried by the examples; without them (``fedllm eval`` of a checkpoint) the base with the adapter disabled is the
reference, which is the starting policy only for strategies that never change the base. A run's evaluation before
round 1 evaluates the very model those reference log-probabilities were computed from, in the same batches
(:func:`fedllm.engine.reference.precompute_eval_references`): it takes the policy's log-probabilities from them
instead of a second forward pass over the pairs (``EvalContext.reference_policy``).
"""

from __future__ import annotations

import torch

from fedllm.common.registry import register_task
from fedllm.data.collate import collate
from fedllm.evaluation.context import EvalContext
from fedllm.evaluation.sources import DataSourceError
from fedllm.evaluation.task import Task
from fedllm.models.preference_loss import (
    PREFERENCE_LOSSES,
    PairLogps,
    answer_lengths,
    needs_reference,
    reference_logps,
    sequence_logps,
)
from fedllm.recipe.schema import PreferenceConfig


@register_task("pref_accuracy")
class PreferenceAccuracy(Task):
    """Reward accuracy and margin of held-out preference pairs (trl's rewards/accuracies, rewards/margins)."""

    name = "pref_accuracy"

    def run(self, ctx: EvalContext) -> dict[str, float]:
        examples = [e for e in ctx.limited(list(ctx.eval_examples or [])) if "rejected_input_ids" in e]
        if not examples:
            raise DataSourceError(
                "pref_accuracy scores held-out preference pairs: give data.format: preference with "
                "data.eval_fraction > 0 or data.eval_path (the run holds no tokenized pair out)"
            )
        pref = ctx.preference or PreferenceConfig()
        model, device = ctx.model, next(ctx.model.parameters()).device
        was_training = model.training
        model.eval()
        chosen, rejected, own = [], [], []
        try:
            with torch.no_grad():
                for start in range(0, len(examples), ctx.cfg.batch_size):
                    batch = collate(examples[start : start + ctx.cfg.batch_size], ctx.tokenizer.pad_token_id)
                    batch = {k: v.to(device) for k, v in batch.items()}
                    if ctx.reference_policy and "ref_logps" in batch:  # the model is the reference itself
                        policy = PairLogps(batch["ref_logps"], answer_lengths(batch))
                    else:
                        policy = sequence_logps(model, batch)
                    ref = reference_logps(model, batch) if needs_reference(pref) else torch.zeros_like(policy.logps)
                    _, c, r = PREFERENCE_LOSSES[pref.loss](policy, ref, pref)
                    chosen += c.tolist()
                    rejected += r.tolist()
                    lc, lr = policy.logps.chunk(2)
                    own += (lc > lr).tolist()
        finally:
            model.train(was_training)
        results = ctx.result_file(self.name, {"model": ctx.fingerprint, "loss": pref.loss, "beta": pref.beta})
        for i, (c, r, o) in enumerate(zip(chosen, rejected, own, strict=True)):
            results.put({"id": i, "chosen_reward": c, "rejected_reward": r, "model_prefers_chosen": bool(o)})
        n = len(chosen)
        results.metrics = {
            "accuracy": sum(c > r for c, r in zip(chosen, rejected, strict=True)) / n,
            "margin": sum(c - r for c, r in zip(chosen, rejected, strict=True)) / n,
            "chosen_reward": sum(chosen) / n,
            "rejected_reward": sum(rejected) / n,
            "logp_accuracy": sum(own) / n,
        }
        results.save(list(range(n)))
        return dict(results.metrics)
