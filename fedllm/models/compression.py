"""Blockwise 8-bit and 4-bit compression of the tensors a round sends (``federation.compression``).

The quantisers are bitsandbytes' own (``bitsandbytes.functional``; its CPU path): ``int8`` is
``quantize_blockwise`` (the dynamic 8-bit code of Dettmers et al. 2022, one fp32 absmax per block), ``nf4`` and
``fp4`` are ``quantize_4bit`` (two 4-bit codes a byte, one fp32 absmax per block; QLoRA's NormalFloat and
bitsandbytes' FP4). What travels is exactly the codes and the absmax of every block: the code tables are
constants both sides hold, and a tensor's name and shape travel as they do uncompressed.

Error feedback (Seide et al. 2014, 1-bit SGD; Karimireddy et al. 2019; EF21, Richtárik et al. 2021): the sender
quantises ``x + e`` and keeps the new residual ``e ← x + e − Q(x + e)``, so what quantisation drops in one round is
sent in a later one. A client quantises its change against the state it received (``upload − received``), the
server the state it sends.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fedllm.models.state import StateDict

KINDS = ("none", "int8", "nf4", "fp4")
"""``federation.compression.upload`` / ``download`` values."""

BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)
"""Block sizes bitsandbytes' blockwise quantisers take for both 8-bit and 4-bit codes."""

ABSMAX_BYTES = 4  # one fp32 absmax per block


@dataclass
class Packed:
    """One tensor as it travels compressed: the codes, the absmax of each block, and how to read them back."""

    codes: torch.Tensor  # uint8: one code a byte (int8), two a byte (nf4, fp4)
    absmax: torch.Tensor  # fp32, one per block
    shape: tuple[int, ...]
    kind: str
    block_size: int

    @property
    def num_bytes(self) -> int:
        """Bytes on the wire: every code byte and every block's fp32 absmax."""
        return self.codes.numel() * self.codes.element_size() + self.absmax.numel() * ABSMAX_BYTES


def packed_bytes(numel: int, kind: str, block_size: int) -> int:
    """Bytes of a tensor of ``numel`` values compressed as ``kind`` (what :attr:`Packed.num_bytes` gives)."""
    if kind == "none":
        raise ValueError("packed_bytes of an uncompressed tensor")
    codes = numel if kind == "int8" else (numel + 1) // 2
    return codes + math.ceil(numel / block_size) * ABSMAX_BYTES


def wire_bytes(state: Mapping[str, torch.Tensor], kind: str, block_size: int) -> int:
    """Bytes of ``state`` sent compressed as ``kind``, from the shapes alone (meta tensors too): what
    :func:`compress_state` counts."""
    return sum(packed_bytes(v.numel(), kind, block_size) if compressible(v) else v.numel() * v.element_size()
               for v in state.values())


def pack(t: torch.Tensor, kind: str, block_size: int) -> Packed:
    """``t`` quantised blockwise by bitsandbytes (on the CPU, in fp32)."""
    import bitsandbytes.functional as bnbf

    x = t.detach().to("cpu", torch.float32).contiguous()
    if kind == "int8":
        codes, state = bnbf.quantize_blockwise(x.reshape(-1), blocksize=block_size)
    elif kind in ("nf4", "fp4"):
        codes, state = bnbf.quantize_4bit(x.reshape(-1), blocksize=block_size, quant_type=kind)
    else:
        raise ValueError(f"compression kind {kind!r}: expected one of {', '.join(KINDS[1:])}")
    return Packed(codes.reshape(-1), state.absmax.to(torch.float32), tuple(t.shape), kind, block_size)


def unpack(p: Packed) -> torch.Tensor:
    """The fp32 tensor the receiver reads back from ``p`` (bitsandbytes' dequantisation)."""
    import bitsandbytes.functional as bnbf

    n = math.prod(p.shape)
    if p.kind == "int8":
        flat = bnbf.dequantize_blockwise(p.codes, absmax=p.absmax, blocksize=p.block_size)
    else:
        state = bnbf.QuantState(absmax=p.absmax, shape=torch.Size([n]), blocksize=p.block_size,
                                quant_type=p.kind, dtype=torch.float32, code=bnbf.get_4bit_type(p.kind, device="cpu"))
        flat = bnbf.dequantize_4bit(p.codes.reshape(-1, 1), state)
    return flat.reshape(p.shape)


def compressible(t: torch.Tensor) -> bool:
    """Whether a tensor is compressed (floating and not empty); integer tensors travel as they are."""
    return t.is_floating_point() and t.numel() > 0


def compress_state(values: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor],
                   residual: Mapping[str, torch.Tensor], kind: str, block_size: int,
                   error_feedback: bool) -> tuple[StateDict, StateDict, dict[str, Packed], int]:
    """Compress ``values`` as changes from ``reference`` with error feedback.

    Each floating tensor ``v`` travels as ``pack(v − ref + e)`` (``ref`` = ``reference[k]`` when it has ``v``'s
    shape, else zero; ``e`` = ``residual[k]`` or zero); the receiver reads back ``ref + unpack(...)``.

    Returns:
        ``(read back, new residual, packed, bytes)``: what the receiver holds (in each value's dtype and device),
        the residuals kept for the next round (empty without error feedback; those of tensors not in ``values`` carried over), the packed tensors (what a
        transport carries) and the bytes sent (packed tensors plus the uncompressed ones as stored).
    """
    out: StateDict = {}
    # a tensor not sent this time keeps its residual until it is (RoLoRA uploads one factor a round)
    kept: StateDict = {k: e for k, e in residual.items() if k not in values} if error_feedback else {}
    packed: dict[str, Packed] = {}
    total = 0
    for key, v in values.items():
        if not compressible(v):
            out[key] = v
            total += v.numel() * v.element_size()
            continue
        ref = reference.get(key)
        base = ref.detach().to("cpu", torch.float32) if ref is not None and ref.shape == v.shape else None
        x = v.detach().to("cpu", torch.float32) - (base if base is not None else 0.0)
        if error_feedback and key in residual:
            x = x + residual[key].to("cpu", torch.float32)
        p = pack(x, kind, block_size)
        sent = unpack(p)
        if error_feedback:
            kept[key] = x - sent
        packed[key] = p
        total += p.num_bytes
        out[key] = (sent + base if base is not None else sent).to(v.device, v.dtype)
    return out, kept, packed, total


def read_packed(packed: Mapping[str, Packed], plain: Mapping[str, torch.Tensor],
                reference: Mapping[str, torch.Tensor], like: Mapping[str, torch.Tensor] | None = None) -> StateDict:
    """Receiver side of :func:`compress_state`: ``ref + unpack(p)`` for each packed tensor, ``plain`` as given.

    ``like``: the dtype each key is read back in (default fp32)."""
    out: StateDict = dict(plain)
    for key, p in packed.items():
        ref = reference.get(key)
        sent = unpack(p)
        if ref is not None and tuple(ref.shape) == p.shape:
            sent = sent + ref.detach().to("cpu", torch.float32)
        out[key] = sent.to(like[key].dtype) if like is not None and key in like else sent
    return out
