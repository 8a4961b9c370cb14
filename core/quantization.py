"""The weight-only quantization contract (the ``register_quantization_methods`` hook).

A quantization method turns one dense weight ``W [N, K]`` (output features x input features,
already loaded in the model's dtype) into a :class:`QuantizedWeight`, which the model's linear
layers, LM head and embedding then use instead of ``W``. Activations stay in the model's dtype
(weight-only quantization). A method is registered as a :class:`QuantizationMethodSpec`::

    from paged.core.hookspecs import hookimpl
    from paged.core.quantization import QuantizationMethodSpec

    @hookimpl
    def register_quantization_methods():
        return [QuantizationMethodSpec(name="my-awq", quantize=quantize_awq, options=AWQOptions)]

Checkpoints that are already block-quantized (GGUF ``Q4_0`` ... ``Q8_0`` and the K-quants
``Q2_K`` ... ``Q6_K``) hand each weight's :class:`BlockScales` to ``quantize``: a method whose
format can hold them (the bundled ``gguf`` holds every one of them as stored; ``int4`` with groups
of 32 holds Q4_0 and Q4_1) keeps the checkpoint's codes instead of computing its own, so nothing
is lost a second time.

Invariants: ``quantize`` is called once per weight at start-up (never per step); the returned
object never changes afterwards; ``linear``/``embedding`` return the model's dtype.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import torch
from pydantic import BaseModel

from paged.core.loading import gguf_blocks

# model.quantization values with a built-in meaning (the rest name registered methods)
NONE = "none"
AUTO = "auto"


@dataclass(frozen=True)
class BlockScales:
    """The block quantization a checkpoint stores for one weight ``W [N, K]``: along each row,
    blocks of ``block`` input features share ``scale`` and ``offset`` (``[N, K // block]``,
    float32), and ``W[n, k] = scale[n, k // block] * code[n, k] + offset[n, k // block]``.

    ``kind`` is the GGUF type name (``paged.core.loading.gguf_blocks`` has the table): ``q4_0``
    (codes 0..15, offset ``-8 * d``), ``q4_1`` (codes 0..15, offset the block's ``m``),
    ``q5_0``/``q5_1`` (codes 0..31), ``q8_0`` (codes -128..127, offset 0), and the K-quants
    ``q2_k``, ``q3_k``, ``q4_k``, ``q5_k`` (blocks of 32) and ``q6_k`` (blocks of 16) with codes
    0 .. 2**bits - 1. A GGUF converted by paged stores the codes (``stored_codes``, what
    ``codes()`` returns); otherwise they are recovered from the dequantized weight.

    K-quants derive each block's scale from a super-block of ``super_block`` inputs: ``scale =
    super_scale * scale_codes`` and ``offset = super_offset * offset_codes`` (``super_*``
    ``[N, K // super_block]`` float32 holding float16 values, ``*_codes`` int8 ``[N, K //
    block]``), exactly; the legacy types have ``super_block == block`` and codes 1. These fields
    are None for checkpoints converted before they existed.
    """

    kind: str
    scale: torch.Tensor
    offset: torch.Tensor
    block: int = 32
    stored_codes: torch.Tensor | None = None  # uint8 [N, K] (int8 for q8_0)
    super_block: int | None = None
    super_scale: torch.Tensor | None = None
    super_offset: torch.Tensor | None = None
    scale_codes: torch.Tensor | None = None
    offset_codes: torch.Tensor | None = None

    @property
    def bits(self) -> int:
        """The code width of ``kind`` (``gguf_blocks.TYPES``; 4 for a kind it does not list)."""
        t = gguf_blocks.TYPES.get(self.kind)
        return t.bits if t is not None else 4

    @property
    def code_range(self) -> tuple[int, int]:
        return (-128, 127) if self.kind == "q8_0" else (0, 2**self.bits - 1)

    def codes(self, weight: torch.Tensor) -> torch.Tensor:
        """The integer codes (int32 ``[N, K]``) whose dequantization is ``weight``: the stored
        codes when there are some, else recovered, exactly for a weight that was dequantized from
        these scales in float32 (a zero scale gives code 0)."""
        if self.stored_codes is not None:
            return self.stored_codes.to(torch.int32)
        n, k = weight.shape
        w = weight.float().view(n, k // self.block, self.block)
        scale = self.scale.unsqueeze(-1)
        q = torch.where(scale == 0, 0.0, (w - self.offset.unsqueeze(-1)) / torch.where(scale == 0, 1.0, scale))
        lo, hi = self.code_range
        return q.round().clamp(lo, hi).to(torch.int32).view(n, k)

    def dequantize(self, codes: torch.Tensor) -> torch.Tensor:
        """``scale * code + offset`` in float32 (what the checkpoint's own dequantizer computes)."""
        n, k = codes.shape
        q = codes.float().view(n, k // self.block, self.block)
        return (self.scale.unsqueeze(-1) * q + self.offset.unsqueeze(-1)).view(n, k)

    def _fields(self) -> dict[str, tuple[torch.Tensor, int]]:
        """Tensor field -> (tensor, inputs per column), for those present."""
        per = {"scale": self.block, "offset": self.block, "stored_codes": 1, "scale_codes": self.block,
               "offset_codes": self.block, "super_scale": self.super_block, "super_offset": self.super_block}
        return {name: (getattr(self, name), n) for name, n in per.items() if getattr(self, name) is not None}

    def rows(self, start: int, length: int) -> "BlockScales":
        return dataclasses.replace(self, **{f: t.narrow(0, start, length) for f, (t, _) in self._fields().items()})

    def columns(self, start: int, length: int) -> "BlockScales | None":
        """Input features ``[start, start + length)`` (a row-parallel shard), or None where the
        range cuts a block or super-block."""
        widest = self.super_block or self.block
        if start % widest or length % widest:
            return None
        return dataclasses.replace(
            self, **{f: t.narrow(1, start // per, length // per) for f, (t, per) in self._fields().items()}
        )

    @staticmethod
    def stack(parts: "list[tuple[BlockScales, int]]", rows: int) -> "BlockScales | None":
        """Row blocks ``(scales, first destination row)`` -> one ``BlockScales`` of ``rows`` rows
        (None unless every part has the same kind, block sizes and fields)."""
        first = parts[0][0]
        fields = first._fields()
        if any((b.kind, b.block, b.super_block, set(b._fields())) != (first.kind, first.block, first.super_block, set(fields))
               for b, _ in parts):
            return None
        out = {}
        for name, (tensor, _) in fields.items():
            whole = tensor.new_zeros((rows, tensor.shape[1]))
            for b, dest in parts:
                part = getattr(b, name)
                whole[dest : dest + part.shape[0]] = part
            out[name] = whole
        return dataclasses.replace(first, **out)


@runtime_checkable
class QuantizedWeight(Protocol):
    """One quantized weight ``W [N, K]`` and the products the model needs from it."""

    shape: tuple[int, int]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T (+ bias)`` for ``x [M, K]`` -> ``[M, N]`` in ``x``'s dtype."""

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``W[ids]`` -> ``[T, K]`` in the model's dtype (the embedding table)."""

    def dequantize(self) -> torch.Tensor:
        """The dense ``W`` this object stands for, in the model's dtype (tests, dense copies)."""

    def nbytes(self) -> int:
        """Bytes held (codes, scales, any dense copy)."""

    # Optional (not part of the protocol's check): ``linear_float(x) -> [M, N]`` float32, ``x W^T``
    # with the sums not rounded to ``x``'s dtype; the LM head (``ParallelLMHead``) uses it for the
    # logits where a weight has it.


@dataclass(frozen=True)
class QuantizationMethodSpec:
    """A weight-only quantization method.

    ``quantize(weight [N, K], scales: BlockScales | None, options) -> QuantizedWeight``, with
    ``options`` an instance of ``options`` (or None); it may return None to leave a weight
    dense (a shape its layout cannot hold). ``is_available(device, dtype)`` returns ``(ok,
    reason)``, cheap and never raising. ``keeps``: the checkpoint block kinds
    (``BlockScales.kind``) this method is the home for, at their bit width (``int4`` holds
    Q4_0/Q4_1 exactly; ``int8`` holds Q8_0 with one scale per row instead of per block):
    ``quantization=auto`` sends each block-quantized weight to the method that keeps its kind.

    Optional, for the packed-weight cache (``paged.core.loading.quantize``: a warm start reads
    the quantized weights instead of computing them): ``restore(tensors, metadata, options) ->
    QuantizedWeight | None`` rebuilds a weight from what its ``cache_tensors()`` returned
    (``(dict of plain tensors, dict of str)``), or returns None when they do not fit this process
    (another kernel layout: it is then quantized again). ``cache_version`` names the stored
    layout; change it when ``cache_tensors`` changes, and old caches are ignored.
    """

    name: str
    quantize: Callable[[torch.Tensor, BlockScales | None, Any], QuantizedWeight | None]
    options: type[BaseModel] | None = None
    description: str = ""
    is_available: Callable[[torch.device, torch.dtype], tuple[bool, str]] = field(
        default=lambda device, dtype: (True, "")
    )
    keeps: tuple[str, ...] = ()
    restore: Callable[[dict[str, torch.Tensor], dict[str, str], Any], QuantizedWeight | None] | None = None
    cache_version: str = ""


def choose_auto(
    methods: dict[str, QuantizationMethodSpec], checkpoint_kinds: dict[str, int], device: torch.device, dtype: torch.dtype
) -> str:
    """``quantization=auto``'s method for the weights without block scales: on a checkpoint
    stored block-quantized, the available method that keeps the most of its quantized weights
    (ties: the first registered); else ``none``.
    ``checkpoint_kinds``: block kind -> number of weights stored that way."""
    best, best_kept = NONE, 0
    for spec in methods.values():
        if not spec.is_available(device, dtype)[0]:
            continue
        kept = sum(n for kind, n in checkpoint_kinds.items() if kind in spec.keeps)
        if kept > best_kept:
            best, best_kept = spec.name, kept
    return best
