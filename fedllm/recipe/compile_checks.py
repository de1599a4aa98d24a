"""Recipe checks of ``train.compile`` and ``train.pad_to_multiple_of`` (:mod:`fedllm.engine.compiled`).

Refused, with the reason:

* ``train.compile`` other than false, true or cudagraphs (YAML's 0 and 1 pass the schema's literal as false and
  true);
* ``train.pad_to_multiple_of`` not a positive integer, or above 1 with ``train.packing`` (a packed micro-batch has no
  padded ends to bound: its rows take every width);
* ``cudagraphs`` without the model on one GPU (``model.device_map: cuda`` or ``cuda:N``): CUDA graphs capture CUDA
  kernels; a CPU has none, and ``auto`` may spread the layers over several devices and the CPU;
* ``cudagraphs`` with ``train.grad_accum > 1``: the parameter gradients of one micro-batch's replay may be the
  graph's own output memory, which the next micro-batch's replay reuses before the optimizer step reads them; not
  checked on a GPU, so refused;
* ``train.compile`` with ``train.packing`` on a GPU (``model.device_map`` other than null or cpu): packed rows take
  any width up to their capacity (on a GPU each width a compiled graph of its own, ``dynamic=False``), and the
  padding that bounds the widths is what packing removes; on a CPU one graph takes every width;
* ``train.compile`` with ``train.clients_per_pass > 1``: the batched pass (:mod:`fedllm.engine.batched_clients`)
  trains outside the client loop that compiles the layers, so the key would do nothing;
* ``train.compile`` with ``privacy.mechanism: dp_sgd``: opacus computes per-example gradients with forward and
  backward hooks on the LoRA layers inside the compiled blocks; that combination has not been checked, so it is
  refused rather than run unchecked.
"""

from __future__ import annotations

from typing import Any

from fedllm.recipe.schema import Recipe


def compile_problems(r: Recipe) -> list[tuple[str, Any, str]]:
    """``(key, given, expected)`` of ``train.compile`` / ``train.pad_to_multiple_of`` (no torch imported)."""
    tr, p = r.train, []
    multiple = tr.pad_to_multiple_of
    if multiple is not None and multiple < 1:
        p.append(("train.pad_to_multiple_of", multiple, "a positive integer or null"))
    elif multiple is not None and multiple > 1 and tr.packing:
        expected = "null or 1 with train.packing (packed rows have no padded ends to round up)"
        p.append(("train.pad_to_multiple_of", multiple, expected))
    if not (isinstance(tr.compile, bool) or tr.compile == "cudagraphs"):
        return p + [("train.compile", tr.compile, "false, true or cudagraphs")]
    if not tr.compile:
        return p
    given = tr.compile
    device_map = r.model.device_map or "cpu"
    if given == "cudagraphs" and device_map.split(":")[0] != "cuda":
        expected = (f"true or false with model.device_map: {r.model.device_map or 'null'} (CUDA graphs need the "
                    "model on one GPU: model.device_map: cuda)")
        p.append(("train.compile", given, expected))
    if given == "cudagraphs" and tr.grad_accum > 1:
        expected = (f"true or false with train.grad_accum: {tr.grad_accum} (a replay's gradients may live in memory the "
                    "next micro-batch's replay reuses; not checked on a GPU)")
        p.append(("train.compile", given, expected))
    reasons = []
    if tr.packing and device_map != "cpu":
        reasons.append(f"with train.packing and model.device_map: {r.model.device_map} (packed rows take every width, "
                       "on a GPU each a graph of its own; the padding that bounds the widths is what packing removes; "
                       "on a CPU, model.device_map: null, one graph takes every width)")
    if tr.clients_per_pass > 1:
        reasons.append(f"with train.clients_per_pass: {tr.clients_per_pass} (the batched pass trains outside the "
                       "client loop that compiles the layers)")
    if r.privacy.mechanism == "dp_sgd":
        reasons.append("with privacy.mechanism: dp_sgd (opacus's per-example gradient hooks inside compiled layers "
                       "are not checked)")
    return p + [("train.compile", given, f"false {why}") for why in reasons]
