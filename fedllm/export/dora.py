"""Exports of a DoRA run (``lora.use_dora``; Liu et al. 2024, "DoRA: Weight-Decomposed Low-Rank Adaptation", §4.1).

A DoRA layer computes ``W' = m ⊙ (W + s·B·A) / ‖W + s·B·A‖_c`` (the column norm of each output row, Eq. 5), so
its change is no low-rank product and the SVD refactoring of :mod:`fedllm.export.adapter` does not apply. The
strategies DoRA runs with keep no factors or residuals outside the adapter and the base
(:mod:`fedllm.recipe.compression_checks`), so the run's model is exactly its current base plus its PEFT DoRA adapter:
the merged export is PEFT's own ``merge_and_unload`` of it; the adapter export, for a strategy that never changes
the base, is that adapter (B, A, the magnitude vector ``m`` and the trained heads) on the original base (after a
merging strategy the changed base under DoRA's norm is no adapter on the original: refused). Both are checked on
the probe input.

A personal model of pFedLoRU or FedLoRA-PFL adds its private adapter ``s_p·L·U`` after the DoRA layer (a forward
hook, :mod:`fedllm.strategies.private_adapter`), as PEFT adds a plain adapter beside a DoRA one: the merged weight
is ``m ⊙ V / ‖V‖_c + s_p·L·U``, PEFT's merge plus the private product (:func:`private_products`); as an adapter it
is refused (one DoRA adapter cannot hold a term outside its norm). FlexLoRA's global model stacks its kept pieces
``Σ_j s_j·B_j A_j`` into the DoRA factors (:func:`fedllm.strategies.flexlora.stack_into_dora`): the merged export
adds them to the base weight first (:func:`kept_products`), then PEFT merges ``m̄ ⊙ (W0 + ΔW) / ‖W0 + ΔW‖_c``; the
adapter export is the same stack as one DoRA adapter of rank ``Σ_k r_k`` on the original base
(:func:`stacked_factors`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from fedllm.export.errors import ExportInputError
from fedllm.export.source import Source, load_original_base, probe_inputs, probe_logits, to_fp32
from fedllm.models.state import DTYPES

PEFT_PREFIX = "base_model.model."


def is_dora(model: Any) -> bool:
    """True when ``model`` is a PEFT model whose active adapter uses DoRA."""
    config = getattr(model, "peft_config", {}).get(getattr(model, "active_adapter", "default"))
    return bool(getattr(config, "use_dora", False))


@torch.no_grad()
def write_dora_adapter(model: Any, tokenizer: Any, strategy: Any, source: Source, out: Path, dtype: str,
                       rank: int | None, check: Any, with_base: bool = False) -> dict[str, Any]:
    """Save the run's DoRA adapter on the original base to ``out`` (``check``: the probe check of
    :func:`fedllm.export.merged.check_probe`); see the module docstring."""
    from peft import get_peft_model

    if getattr(strategy, "modifies_base", False):
        raise ExportInputError(f"--format adapter: the run's strategy {strategy.name!r} merged its updates into the "
                               "base; DoRA's column norm of the changed base is no adapter on the original base: "
                               "export --format merged")
    if rank is not None:
        raise ExportInputError(f"--rank {rank}: a DoRA adapter is exported as trained (its change is no low-rank "
                               "product to truncate); leave --rank out")
    if private_products(model, strategy):
        raise ExportInputError(f"--format adapter: this personal model of {strategy.name!r} adds its private adapter "
                               "after the DoRA layer, outside DoRA's column norm; one DoRA adapter cannot hold it: "
                               "export --format merged")
    original = load_original_base(source, tokenizer)
    if with_base:
        original.save_pretrained(str(out / "base"))
        tokenizer.save_pretrained(str(out / "base"))
    to_fp32(original)
    config = copy.deepcopy(model.peft_config[model.active_adapter])
    stacks = stacked_factors(model, strategy)
    if stacks:  # the pieces and the adapter side by side, at scaling 1 (lora_alpha = r)
        config.r = config.lora_alpha = next(iter(stacks.values()))[1].shape[0]
    exported = get_peft_model(original, config).eval()
    exported.peft_config["default"].base_model_name_or_path = source.recipe.model.name
    params = dict(exported.named_parameters())
    marker = f".{model.active_adapter}."
    trained = {n.replace(marker, ".default."): p for n, p in model.named_parameters()
               if ".lora_" in n or ".modules_to_save." in n}
    for name, (b, a) in stacks.items():
        trained[f"{name}.lora_B.default.weight"], trained[f"{name}.lora_A.default.weight"] = b, a
    missing = sorted(set(trained) - set(params))
    if missing:
        raise RuntimeError(f"the exported DoRA model lacks {missing[:3]}")
    for name, value in trained.items():
        params[name].copy_(value)
    inputs = probe_inputs(tokenizer)
    diff = check(probe_logits(model, inputs), probe_logits(exported, inputs), str(source.checkpoint))
    for name, param in exported.named_parameters():
        if name.startswith(PEFT_PREFIX) and (".lora_" in name or ".modules_to_save." in name):
            param.data = param.data.to(DTYPES[dtype])
    exported.save_pretrained(str(out), save_embedding_layers=False)
    tokenizer.save_pretrained(str(out))
    layers = sum(1 for n in trained if ".lora_magnitude_vector." in n)
    return {"layers": layers, "rank_min": config.r, "rank_max": config.r, "exact_rank_max": config.r, "exact": True,
            "stacked_layers": len(stacks),
            "truncated_layers": [], "rel_error_max": 0.0, "methods": {"dora": layers}, "use_dora": True,
            "max_logit_diff": diff, "checked": True, "r": config.r, "alpha": config.lora_alpha}


@torch.no_grad()
def private_products(model: Any, strategy: Any) -> dict[str, torch.Tensor]:
    """``{layer: s_p·L·U}`` (float64, ``out × in``) of the private adapters a personalized strategy's hooks add after
    each DoRA layer (:class:`fedllm.strategies.private_adapter.PrivateFactors`), those not zero; ``{}`` otherwise."""
    layers, attr = getattr(strategy, "private_layers", None), getattr(strategy, "private_attr", None)
    out = {}
    for name in layers or {}:
        private = getattr(model.get_submodule(name), attr)
        product = private.scale * (private.L.double() @ private.U.double())
        if product.any():
            out[name.removeprefix(PEFT_PREFIX)] = product
    return out


def stacked_factors(model: Any, strategy: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{layer: (B', A')}`` with ``B'A' = s·B A + Σ_j s_j·B_j A_j`` (``B' = [s·B, s_1 B_1, …]``, ``A' = [A; A_1; …]``):
    the adapter and the strategy's kept pieces stacked as one DoRA adapter of scaling 1 (FlexLoRA), the adapter
    left out where it is zero; ``{}`` when nothing is kept outside the base.

    Raises:
        ExportInputError: the stacks have different ranks in different layers (one adapter rank for all)."""
    if not kept_products(strategy):
        return {}
    out = {}
    for name, pieces in strategy.kept_factors().items():
        module = model.get_submodule(name)
        b, a = module.lora_B[model.active_adapter].weight, module.lora_A[model.active_adapter].weight
        scaling = module.scaling[model.active_adapter]
        parts = [(pb.float().cpu() * s, pa.float().cpu()) for pb, pa, s in pieces]
        if b.any():
            parts.insert(0, (b.detach().float().cpu() * scaling, a.detach().float().cpu()))
        out[name] = (torch.cat([pb for pb, _ in parts], 1), torch.cat([pa for _, pa in parts], 0))
    ranks = {a.shape[0] for _, a in out.values()}
    if len(ranks) > 1:
        raise ExportInputError(f"--format adapter: the kept pieces stack to ranks {sorted(ranks)} in different "
                               "layers; one DoRA adapter has one rank: export --format merged")
    return out


def kept_products(strategy: Any) -> dict[str, torch.Tensor]:
    """``{layer: Σ_j s_j·B_j A_j}`` (float64) of the pieces a strategy keeps beside the base and not in it."""
    if strategy is None or getattr(strategy, "kept_in_base", False):
        return {}
    out = {}
    for name, pieces in strategy.kept_factors().items():
        if pieces:
            out[name] = sum(s * (b.double().cpu() @ a.double().cpu()) for b, a, s in pieces)
    return out


@torch.no_grad()
def merge_dora(model: Any, strategy: Any = None) -> Any:
    """The run's model with its DoRA adapter folded into the base weights by PEFT (``merge_and_unload``, in fp32),
    after the strategy's kept pieces (:func:`kept_products`), plus a personal model's private products
    (:func:`private_products`)."""
    to_fp32(model)
    private = private_products(model, strategy)
    for name, product in kept_products(strategy).items():  # inside DoRA's norm: into the base before PEFT's merge
        weight = model.get_submodule(name).get_base_layer().weight
        weight.copy_((weight.double() + product.to(weight.device)).to(weight.dtype))
    merged = model.merge_and_unload()
    for name, product in private.items():
        weight = merged.get_submodule(name).weight
        weight.copy_((weight.double() + product).to(weight.dtype))
    return merged
