"""The bundled ``gguf`` quantization method: a GGUF file's quantized weights kept as the file
stores them (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), at every batch size,
with no dense copy (``paged.plugins.gguf_kernels`` has the layout and the kernels).

Each weight holds its codes and two-level scales as the file does (2- and 3-bit codes widened to
4): resident weights are 1.0-1.12x the file's bytes for the 4- to 8-bit types. Few rows (decode)
run the exact ``vdpbf16ps`` kernel (on CPUs with AMX, 2 rows or more of the interleaved layout the
same exact codes as AMX tiles; or, with ``int8_activations``, x quantized to int8 per 32
inputs and ``vpdpbusd``, as llama.cpp does: faster, less exact); from ``amx_min_rows`` rows on, CPUs with AMX dequantize 32 weight
rows at a time into bfloat16 tiles, and from ``panel_min_rows`` rows on CPUs without AMX into
bfloat16 panels for a register-blocked ``vdpbf16ps`` kernel (with ``int8_panels``, int8 codes and
int8 activations for ``vpdpbusd``: faster, less exact). Without the kernels (no AVX-512 BF16) the weights keep
their codes and scales as tensors and each call dequantizes with torch ops (correct, slow).
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from paged.core.loading.gguf_blocks import TYPES
from paged.core.quantization import BlockScales
from paged.plugins import gguf_kernels

logger = logging.getLogger(__name__)


# CPUs with AMX, from how many rows the dequantized bf16 tiles beat the few-rows kernels, by the
# bits a code is held in (benchmarks/gguf_gemm.py, 2-core Xeon, 2026-12-06: the interleaved
# layout's tiles of exact codes against the dequantized tiles at 16 / 24 / 32 rows, Q8_0 11.1 /
# 17.1 / 19.1 ms against 12.4 / 14.0 / 13.3, Q6_K 15.3 / 25.0 / 28.6 against 21.4 / 24.3 / 21.6,
# Q4_1 7.1 / 10.4 / 12.2 against 10.4 / 11.9 / 11.4, Q4_K 10.3 / 16.1 / 18.2 against 17.4 / 21.1
# / 18.3); the row layout's vdpbf16ps kernel is level with the dequantized tiles at 5-8 rows
AMX_MIN_ROWS_INTERLEAVED = {4: 28, 5: 28, 6: 24, 8: 20}
AMX_MIN_ROWS_ROW_LAYOUT = 6


class GGUFOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    amx_min_rows: int | None = Field(
        None, ge=0, description="CPUs with AMX: batches of at least this many rows dequantize 32 weight rows at a "
        "time to bfloat16 AMX tiles (0 = never); fewer rows multiply the exact codes, on AMX tiles for the "
        "interleaved layout. None = as measured by benchmarks/gguf_gemm.py on the 2-core Xeon: for the "
        "interleaved layout 20 (8-bit codes), 24 (6-bit), 28 (4- and 5-bit), where its few-rows tiles stop "
        "winning; 6 for the row layout (vdpbf16ps: 5-8)",
    )
    panel_min_rows: int = Field(
        16, ge=0, description="on CPUs without AMX, batches of at least this many rows dequantize 32 weight rows at "
        "a time to bfloat16 panels for a register-blocked vdpbf16ps kernel (0 = never): benchmarks/gguf_gemm.py "
        "measures the crossing, 8-16 rows on the 2-core EPYC (2.1x the few-rows kernel at 64 rows, 2.7x at 128)",
    )
    int8_activations: bool = Field(
        False, description="below the many-rows path (amx_min_rows with AMX, panel_min_rows without), quantize x to int8 per 32 inputs (as llama.cpp's Q8 activations) "
        "and multiply with vpdpbusd (CPUs with AVX-512 VNNI): 1.2-1.5x faster decode, but it flips near-ties "
        "(the README's France question on the default model); false = exact products of the codes with bf16 x",
    )
    int8_panels: bool = Field(
        False, description="the many-rows path on CPUs without AMX (from panel_min_rows rows): x quantized to int8 "
        "per 32 inputs and the panels' codes kept as bytes, multiplied with vpdpbusd (AVX-512 VNNI); false = bfloat16 "
        "panels (the weights dequantized and rounded to bf16, vdpbf16ps)",
    )
    interleave_types: tuple[str, ...] = Field(
        gguf_kernels.INTERLEAVABLE_TYPES, description="the GGUF types (of q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, q6_k; a list or a comma-separated string, "
        "empty = none) kept in the interleaved layout where their rows are a multiple of 16: 16 rows' codes side by "
        "side, so that a vdpbf16ps lane is a weight row and an x row enters as a broadcast pair (benchmarks/gguf_gemm.py, "
        "2-core EPYC, since its reads prefetch the next tiles: Q4_1 1 / 2 / 5 / 8 rows 18% / 34% / 34% / 37% faster "
        "than the row layout, Q8_0 18% / 23% / 25% / 30%, Q8_0 panels at 16-128 rows 4-17% faster; at 128-512 rows "
        "Q4_1's panels were 3-6% slower; Q5_0 1 / 2 / 3 / 5 / 8 rows 20% / 29% / 36% / 30% / 34% faster, its panels at "
        "16 / 64 / 128 / 512 rows 16% / 7% / 8% / 0.5%; K-quants at 768-2048 inputs, 1 / 2 / 3 rows: Q4_K 19% / "
        "28% / 42%, Q6_K 22% / 30% / 39% faster, and 5-8 rows 4-25%, panels 1-22%). The int8 paths "
        "(int8_activations, int8_panels) read the row layout, so either of them turns this off",
    )

    @field_validator("interleave_types", mode="before")
    @classmethod
    def _interleavable(cls, value: Any) -> Any:
        if isinstance(value, str):  # --quantization-option interleave_types=q4_0,q4_1,q8_0
            value = tuple(part.strip() for part in value.split(",") if part.strip())
        bad = [kind for kind in value if kind not in gguf_kernels.INTERLEAVABLE_TYPES]
        if bad:
            raise ValueError(f"interleave_types: {bad} cannot be interleaved; accepted: "
                             f"{', '.join(gguf_kernels.INTERLEAVABLE_TYPES)} (or none)")
        return value

    kernel: bool = Field(True, description="paged's C++ kernels (AVX-512 BF16); false = torch ops (slow)")


@functools.cache
def _warn_once(message: str) -> None:  # once per process, not once per weight
    logger.warning(message)


def _cpu_only(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    if device.type != "cpu":
        return False, f"the GGUF kernels run on the CPU only, not {device.type}"
    return True, ""


class GGUFWeight:
    """One GGUF weight ``W [N, K]`` packed for the kernels (``packed``, ``fmt = (bits, group,
    super_block)``, ``interleave``: 1 for the row layout, 16 for 16 rows interleaved), or, without
    the kernels, as ``codes`` uint8 with float32 ``scale`` and ``offset`` per group."""

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype, options: GGUFOptions, kind: str) -> None:
        self.shape = shape
        self.dtype = dtype
        self.kind = kind
        self.int8_activations = options.int8_activations
        self.int8_panels = options.int8_panels
        self.kernels = gguf_kernels.load() if options.kernel else None
        # the kernel's many-rows path: AMX tiles where the CPU has them, else panels (_set_layout)
        self.amx = self.kernels is not None and self.kernels.amx_available()
        self.amx_min_rows, self.panel_min_rows = options.amx_min_rows, options.panel_min_rows
        if options.int8_panels and (self.kernels is None or self.amx or not self.kernels.int8_activations_available()):
            _warn_once("gguf: int8_panels changes nothing here: it needs the GGUF kernels on a CPU with AVX-512 VNNI "
                       "and without AMX (many rows run the bfloat16 panels, or AMX tiles)")
        # the interleaved layout where the options ask for it (the int8 paths read rows); 1 = the row layout
        self.wants_interleave = kind in options.interleave_types and not (options.int8_activations or options.int8_panels)
        self.packed: torch.Tensor | None = None
        self.fmt: tuple[int, int, int] = (0, 0, 0)
        self.codes = self.scale = self.offset = None
        self._set_layout(1)

    def _set_layout(self, interleave: int) -> None:
        """The packed layout (1: rows; ``X16_ROWS``: interleaved) and with it ``many_min_rows``,
        from how many rows the many-rows path runs: on AMX CPUs ``amx_min_rows``, or its measured
        default for the layout and code width; elsewhere ``panel_min_rows``."""
        self.interleave = interleave
        if not self.amx:
            self.many_min_rows = self.panel_min_rows
        elif self.amx_min_rows is not None:
            self.many_min_rows = self.amx_min_rows
        elif interleave == gguf_kernels.X16_ROWS:
            self.many_min_rows = AMX_MIN_ROWS_INTERLEAVED[gguf_kernels.held_bits(self.fmt[0])]
        else:
            self.many_min_rows = AMX_MIN_ROWS_ROW_LAYOUT

    @classmethod
    def from_scales(cls, weight: torch.Tensor, scales: BlockScales, options: GGUFOptions) -> "GGUFWeight | None":
        self = cls(tuple(weight.shape), weight.dtype, options, scales.kind)
        if self.kernels is not None and weight.dtype == torch.bfloat16:
            try:
                self.packed, self.fmt = gguf_kernels.pack(scales, weight, interleave=self.wants_interleave)
                if self.wants_interleave and gguf_kernels.interleavable(self.shape[0], *self.fmt):
                    self._set_layout(gguf_kernels.X16_ROWS)
                return self
            except ValueError:
                pass  # scales the layout cannot hold exactly (a float16 overflow): the torch form below
        codes = scales.codes(weight)
        if scales.kind == "q8_0":  # as unsigned codes with the offset -128 d
            codes, offset = codes + 128, scales.offset - 128 * scales.scale
        else:
            offset = scales.offset
        self.kernels = None
        self.codes, self.scale, self.offset = codes.to(torch.uint8), scales.scale.float(), offset.float()
        self.fmt = (scales.bits, scales.block, scales.super_block or scales.block)
        return self

    # ---- the products ----

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None:
            xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
            if torch.compiler.is_compiling():
                out = gguf_kernels.gemm(xb, self.packed, self.fmt, self.many_min_rows, self.int8_activations,
                                        self.int8_panels, self.interleave)
            else:
                out = self.kernels.gemm(xb, self.packed, *self.fmt, self.many_min_rows, self.int8_activations,
                                        self.int8_panels, self.interleave)
            if x.dtype != torch.bfloat16:  # (a no-op .to still costs ~1 us, 121 times a decode step)
                out = out.to(x.dtype)
        else:
            out = torch.nn.functional.linear(x, self.dequantize().to(x.dtype))
        return out if bias is None else out + bias

    def linear_float(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T`` in float32 (the LM head: logits as the kernel's fp32 sums give them; rounded
        to bfloat16, whose step at a logit of 25 is 0.125, near-ties became exact ties)."""
        if self.packed is None:
            return self.linear(x, None).float()
        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        if torch.compiler.is_compiling():
            return gguf_kernels.gemm_f32(xb, self.packed, self.fmt, self.many_min_rows, self.int8_activations,
                                         self.int8_panels, self.interleave)
        return self.kernels.gemm_f32(xb, self.packed, *self.fmt, self.many_min_rows, self.int8_activations,
                                     self.int8_panels, self.interleave)

    def native_gemm(self) -> tuple[Any, list[tuple]] | None:
        """For native callers that run ``linear`` without Python (``cpu_layer_ops.DecoderPlan``):
        the kernel's C++ ``gemm`` as a capsule and its arguments after ``x``, one tuple per weight
        (here one); None where ``linear`` does not call it."""
        if self.packed is None:
            return None
        return self.kernels.gemm_capsule, [(self.packed, *self.fmt, self.many_min_rows, self.int8_activations,
                                            self.int8_panels, self.interleave)]

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            flat = ids.reshape(-1)
            if torch.compiler.is_compiling():
                rows = gguf_kernels.dequantize_rows(self.packed, flat, self.shape[1], self.fmt, self.interleave)
            else:
                rows = self.kernels.dequantize_rows(self.packed, flat, self.shape[1], *self.fmt, self.interleave)
            return rows.to(self.dtype).view(*ids.shape, self.shape[1])
        return self._dequantize_rows(ids.reshape(-1)).view(*ids.shape, self.shape[1])

    def dequantize(self) -> torch.Tensor:
        if self.packed is not None:
            return self.embedding(torch.arange(self.shape[0]))
        return self._dequantize_rows(None)

    def _dequantize_rows(self, ids: torch.Tensor | None) -> torch.Tensor:
        codes, scale, offset = (self.codes, self.scale, self.offset) if ids is None else (
            self.codes[ids], self.scale[ids], self.offset[ids])
        t, k = codes.shape
        group = self.fmt[1]
        w = codes.float().view(t, k // group, group) * scale.unsqueeze(-1) + offset.unsqueeze(-1)
        return w.view(t, k).to(self.dtype)

    def nbytes(self) -> int:
        if self.packed is not None:
            return self.packed.numel()
        return self.codes.numel() + 4 * (self.scale.numel() + self.offset.numel())

    # ---- the packed-weight cache ----

    def cache_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        meta = {"shape": json.dumps(self.shape), "dtype": str(self.dtype).removeprefix("torch."),
                "fmt": json.dumps(self.fmt), "kind": self.kind}
        if self.packed is not None:
            meta["interleave"] = str(self.interleave)
            return {"packed": self.packed}, meta
        return {"codes": self.codes, "scale": self.scale, "offset": self.offset}, meta

    @classmethod
    def restore(cls, tensors: dict[str, torch.Tensor], meta: dict[str, str], options: GGUFOptions | None) -> "GGUFWeight | None":
        options = options or GGUFOptions()
        self = cls(tuple(json.loads(meta["shape"])), getattr(torch, meta["dtype"]), options, meta["kind"])
        self.fmt = tuple(json.loads(meta["fmt"]))
        if "packed" in tensors:
            if self.kernels is None:
                return None  # packed for kernels this process does not have: quantize again
            self._set_layout(int(meta.get("interleave", "1")))  # caches from before the interleaved layout: rows
            wanted = gguf_kernels.X16_ROWS if (self.wants_interleave and gguf_kernels.interleavable(
                self.shape[0], *self.fmt)) else 1
            if self.interleave != wanted:
                return None  # packed in the other layout than these options ask for: pack again
            self.packed = tensors["packed"]
        else:
            if self.kernels is not None and self.dtype == torch.bfloat16:
                return None  # stored in the torch form, but the kernels can run here: pack again
            self.kernels = None
            self.codes, self.scale, self.offset = tensors["codes"], tensors["scale"], tensors["offset"]
        return self


def quantize_gguf(weight: torch.Tensor, scales: BlockScales | None, options: GGUFOptions | None) -> GGUFWeight | None:
    """The weight as its GGUF blocks; None (stays dense) for a weight without them, or whose
    scales lack the super-block fields (a K-quant converted before they were stored)."""
    if scales is None or scales.kind not in TYPES:
        return None
    if TYPES[scales.kind].super_block != scales.block and scales.super_scale is None:
        return None
    return GGUFWeight.from_scales(weight, scales, options or GGUFOptions())


def restore_gguf(tensors: dict[str, torch.Tensor], meta: dict[str, str], options: GGUFOptions | None) -> GGUFWeight | None:
    return GGUFWeight.restore(tensors, meta, options)
