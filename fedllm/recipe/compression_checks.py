"""Recipe checks of compressed updates (``federation.compression``) and DoRA (``lora.use_dora``).

What cannot hold is refused at recipe load, with the reason:

* compression under secure aggregation: SecAgg+ masks integers the clients quantise themselves
  (``privacy.secagg``), the server never sees one client's upload to decode;
* compression under client-level DP (``privacy.mechanism: central*``): quantising after clipping can raise an
  update's norm above the bound the noise is calibrated to;
* compression with ``federation.comm_dtype`` other than fp32: the compressed direction sets its own wire format;
* download compression with a strategy outside :data:`DOWNLOAD_COMPRESSION_STRATEGIES` (the reason of each is in
  :data:`DOWNLOAD_REFUSED`), or in a format :data:`DOWNLOAD_KIND_REFUSED` names (FedEx-LoRA with int8);
* DoRA with a strategy outside :data:`DORA_STRATEGIES` and :data:`DORA_MERGE_STRATEGIES` (every registered one is
  in them; a strategy registered from outside fedllm is refused until its server maths is worked out for DoRA's
  column norm of ``W + s·B·A``); a merging one on a half-precision base or with its merges kept beside the base;
  DoRA under DP-SGD (opacus has no per-example gradient of PEFT's magnitude module, which it calls without the
  factors it needs).
"""

from __future__ import annotations

from typing import Any

from fedllm.recipe.schema import DORA_MERGE_STRATEGIES, Recipe

#: Strategies whose server maths reads only the uploads, or measures the clients' progress from what they received
#: (:meth:`fedllm.strategies.base.Strategy.received`: the dequantised download), so the download may be compressed:
#: FedOpt's pseudo-gradient ``θ̄ − θ_received``, FRLoRA's merge ``s·(B̄Ā − B_s·A_s)`` from the factors the clients
#: started from, mFedLoRU's rebuild ``A + α·A_d·A_u`` on the received ``A``; FedLoRU's and FLoRA's merges read the
#: uploads (their merge message travels uncompressed) and their re-initialised factors drop the download residual.
#: HetLoRA, LoRA-FAIR, Fed-SB, FedLoRA-PFL and pFL^MF read only the uploads (HetLoRA's truncated factors and Fed-SB's
#: fixed A, B travel uncompressed); RoLoRA and FedSVD keep the dequantised frozen factor their clients trained against.
#: FedEx-LoRA takes its residual against the factors' next download ``(B̃, Ã)`` and keeps them as the global factors
#: (nf4 and fp4 only: :data:`DOWNLOAD_KIND_REFUSED`).
DOWNLOAD_COMPRESSION_STRATEGIES = frozenset({
    "fedavg", "fedprox", "scaffold", "ffa_lora", "fedsa_lora", "local", "fedmedian", "fedtrimmedavg", "krum",
    "multikrum", "bulyan", "bulyan_multikrum", "fedavgm", "fedadagrad", "fedyogi", "fedadam", "frlora", "frlora_v1",
    "frlora_v2", "frlora_v3", "fedloru", "pfedloru", "mfedloru", "flora", "hetlora", "lora_fair", "fed_sb",
    "fedlora_pfl", "pflmf", "rolora", "fedsvd", "fedex_lora",
})

#: Why download compression is refused with each other strategy (the recipe error's expected value).
DOWNLOAD_REFUSED = {
    "flexlora": ("each client starts from its own SVD hand-back of the kept average, not from the global state: those "
                 "factors travel uncompressed, so a compressed download would save nothing on them"),
}
#: Download formats refused with a strategy that takes others, and why (``{strategy: {format: reason}}``).
DOWNLOAD_KIND_REFUSED = {
    "fedex_lora": {"int8": (
        "its residual W ← W + Σ_k p_k·s·B_k·A_k − s·B̃·Ã is taken against the dequantised download (B̃, Ã), which the "
        "server then holds as its factors, so the next download must send them unchanged; bitsandbytes' dynamic 8-bit "
        "code runs from −0.993 to 1, so re-quantising a dequantised block whose largest magnitude is negative shrinks "
        "its absmax and the clients would continue from other factors than the server's model; nf4 and fp4 map each "
        "block's absmax to a code of ±1 and send a dequantised tensor unchanged: use nf4 or fp4")},
}
DOWNLOAD_REFUSED_DEFAULT = ("fedllm has not worked out which state its server maths assumes the clients started from "
                            "under a compressed download")

#: Strategies that train B, A and DoRA's magnitude vector as plain tensors and aggregate them tensor by tensor,
#: never merging into the base: DoRA holds unchanged (the magnitude is averaged as any trainable tensor). Beside
#: them: ``fedsa_lora`` keeps the magnitude private beside ``B``; ``fedlora_pfl`` averages it with σ (its ``full``
#: σ is the base weight itself, averaged as a tensor) and adds the private τ after the DoRA layer; ``flexlora``
#: stacks its kept pieces inside DoRA's column norm; ``pflmf`` slices the magnitudes from ``U v`` with A and B (each
#: strategy's module docstring says how); ``rolora``, ``lora_fair``, ``fedsvd`` and ``fed_sb`` average it with the
#: example (Fed-SB: uniform) weights while PEFT takes the column norm of the direction their factors give (LoRA-FAIR's
#: refined ``B``, FedSVD's refactorised pair of the same product, Fed-SB's ``B·R·A`` through the ``R`` hook);
#: ``hetlora`` averages it with each layer's norm weights ``p_k``, as that layer's factors.
DORA_STRATEGIES = frozenset({
    "fedavg", "fedprox", "scaffold", "fedavgm", "fedadagrad", "fedyogi", "fedadam", "ffa_lora", "fedmedian",
    "fedtrimmedavg", "krum", "multikrum", "bulyan", "bulyan_multikrum", "local", "fedsa_lora", "fedlora_pfl", "pflmf",
    "flexlora", "rolora", "lora_fair", "hetlora", "fedsvd", "fed_sb",
})


def compression_problems(r: Recipe) -> list[tuple[str, Any, str]]:
    """Problems of ``federation.compression`` with the rest of the recipe."""
    c, fed, pv = r.federation.compression, r.federation, r.privacy
    if c.upload == "none" and c.download == "none":
        return []
    key = "federation.compression.upload" if c.upload != "none" else "federation.compression.download"
    given = c.upload if c.upload != "none" else c.download
    p = []
    if pv.secure_aggregation == "secagg_plus":
        p.append((key, given, ("none with privacy.secure_aggregation: secagg_plus (SecAgg+ sums integer-masked "
                               "uploads the clients quantise themselves; the server never holds one upload to "
                               "decode)")))
    if pv.mechanism in ("central", "central_client_clipping"):
        p.append((key, given, (f"none with privacy.mechanism: {pv.mechanism} (quantising a clipped update can raise "
                               "its norm above privacy.clipping_norm, the bound the noise is calibrated to)")))
    if fed.comm_dtype != "fp32":
        p.append(("federation.comm_dtype", fed.comm_dtype, ("fp32 with federation.compression (the compressed "
                                                            "direction sets its own wire format)")))
    if c.download != "none" and fed.strategy not in DOWNLOAD_COMPRESSION_STRATEGIES:
        why = DOWNLOAD_REFUSED.get(fed.strategy, DOWNLOAD_REFUSED_DEFAULT)
        p.append(("federation.compression.download", c.download,
                  (f"none with federation.strategy: {fed.strategy} ({why}; download compression works with "
                   f"{', '.join(sorted(DOWNLOAD_COMPRESSION_STRATEGIES))})")))
    elif c.download in DOWNLOAD_KIND_REFUSED.get(fed.strategy, {}):
        p.append(("federation.compression.download", c.download,
                  f"nf4 or fp4 with federation.strategy: {fed.strategy} ({DOWNLOAD_KIND_REFUSED[fed.strategy][c.download]})"))
    return p


def dora_problems(r: Recipe) -> list[tuple[str, Any, str]]:
    """Problems of ``lora.use_dora: true`` with the rest of the recipe."""
    if not r.lora.use_dora:
        return []
    p = []
    args = r.federation.strategy_args
    if r.federation.strategy in DORA_MERGE_STRATEGIES:
        if r.model.dtype not in ("fp32", "auto"):  # auto: an fp32 base for these (models.hardware.base_dtype)
            p.append(("model.dtype", r.model.dtype, (f"fp32 or auto with lora.use_dora and {r.federation.strategy} (its "
                      "merges go into an fp32 base in place; a dense residual beside a half-precision base is left "
                      "out of DoRA's column norm)")))
        if args.get("residual", "auto") == "dense" or args.get("accumulate", "merge") != "merge":
            key = "residual" if "residual" in args else "accumulate"
            p.append((f"federation.strategy_args.{key}", args[key], ("the default (merge into the base) with "
                      "lora.use_dora: factors or residuals kept beside the base are left out of DoRA's column norm")))
    elif r.federation.strategy not in DORA_STRATEGIES:
        p.append(("lora.use_dora", True, (f"false with federation.strategy: {r.federation.strategy} (its server "
                  "maths is not worked out for DoRA's column norm of W + s*B*A, which makes the layer non-linear in "
                  "the adapter; DoRA works with "
                  f"{', '.join(sorted(DORA_STRATEGIES | DORA_MERGE_STRATEGIES))})")))
    if r.model.quantization != "none":
        p.append(("lora.use_dora", True, f"false with model.quantization: {r.model.quantization} (not tested here)"))
    if r.privacy.mechanism == "dp_sgd":
        p.append(("lora.use_dora", True, ("false with privacy.mechanism: dp_sgd (opacus computes per-example gradients "
                  "module by module and calls an unsupported module's forward with its input alone; PEFT's DoRA "
                  "magnitude module needs the LoRA factors and the base layer as keyword arguments, so no "
                  "per-example gradient of m exists to clip and noise)")))
    if r.train.clients_per_pass > 1:
        p.append(("train.clients_per_pass", r.train.clients_per_pass,
                  "1 with lora.use_dora (the batched pass computes plain LoRA products)"))
    return p
