"""Bundled weight-only quantization methods (CPU): ``int8`` per output channel and ``int4``
in groups along the input features. Kernels: paged's own (``paged.plugins.quant_kernels``) for
bfloat16 on CPUs with AVX-512 BF16, ~1.5x torch's where the weights stream from memory (a decode
step); elsewhere, or with the option ``avx512_kernel=false``, torch's own
(``aten._weight_int8pack_mm``, ``aten._weight_int4pack_mm_for_cpu``).

Measured on the 2-core AMX machine (same-run A/B under load, the default model's shapes): the
quantized kernels beat oneDNN's packed bfloat16 GEMM 1.3-2.3x for one row (a batch-1 decode
step reads 2-4x fewer bytes), break even around 4 rows and are 4-16x slower from 16 rows on
(they do not use AMX). So by default a dense oneDNN-packed copy serves batches of more than
``quantized_max_rows`` rows (``dense_copy``); without it the weights stay at their quantized
size, the memory-lean choice.

torch's int4 layout (``_convert_weight_to_int4pack_for_cpu``, inner k tiles 1): ``[N, K/2]`` bytes; per
block of 64 output rows, for each input feature ``k`` 32 bytes whose low nibble is row ``j``
and high nibble row ``j + 32`` of the block. The kernel computes ``(code - 8) * scale + zero``
with ``scales_and_zeros [K/G, N, 2]`` in the activation dtype.
"""

from __future__ import annotations

import json

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from paged.core.hookspecs import hookimpl
from paged.core.quantization import BlockScales, QuantizationMethodSpec
from paged.core.loading import gguf_blocks
from paged.plugins import gguf_kernels, gguf_quantization, quant_kernels

_PACK_ROWS = 64  # rows per block of the CPU int4 packed layout


class WeightOnlyOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    quantized_max_rows: int = Field(
        2, ge=0, description="batches of up to this many rows use the quantized kernel"
    )
    dense_copy: bool = Field(
        True,
        description="keep a dense (oneDNN-packed) copy for larger batches: fastest at every batch size, "
        "costs the dense weights' memory; false = the quantized kernel always, least memory",
    )
    avx512_kernel: bool = Field(
        True,
        description="bfloat16 on a CPU with AVX-512 BF16: paged's own kernels (paged.plugins.quant_kernels); "
        "false = torch's (_weight_int4pack_mm_for_cpu, _weight_int8pack_mm)",
    )


class Int4Options(WeightOnlyOptions):
    group_size: int = Field(32, description="input features per scale/zero group (32, 64, 128 or 256)")

    @field_validator("group_size")
    @classmethod
    def _supported(cls, v: int) -> int:
        if v not in (32, 64, 128, 256):
            raise ValueError(f"must be 32, 64, 128 or 256, got {v}")
        return v


def _cpu_only(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    if device.type != "cpu":
        return False, f"the bundled kernels run on the CPU only, not {device.type}"
    if dtype not in (torch.bfloat16, torch.float32, torch.float16):
        return False, f"dtype {dtype} is not supported"
    return True, ""


class _DenseFallback:
    """The dense path for batches of more than ``quantized_max_rows`` rows."""

    def _init_dense(self, options: WeightOnlyOptions, dtype: torch.dtype, make_dense=None) -> None:
        self.max_rows = options.quantized_max_rows
        self.dense: torch.Tensor | None = None
        self.packed_dense: torch.Tensor | None = None
        if options.dense_copy:
            dense = (make_dense or self.dequantize)()
            if dtype == torch.bfloat16 and torch.backends.mkldnn.is_available():
                self.packed_dense = torch.ops.mkldnn._reorder_linear_weight(dense, None)
            else:
                self.dense = dense

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] > self.max_rows:
            if self.packed_dense is not None:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed_dense, bias, "none", [], "")
            if self.dense is not None:
                return torch.nn.functional.linear(x, self.dense, bias)
        out = self._quantized_linear(x)
        return out if bias is None else out + bias

    def _dense_bytes(self) -> int:
        has_copy = self.dense is not None or self.packed_dense is not None
        return self.shape[0] * self.shape[1] * self.dtype.itemsize if has_copy else 0


class Int8Weight(_DenseFallback):
    """``W ~ scale[n] * q[n, k]``, ``q`` int8 symmetric per output channel."""

    def __init__(self, weight: torch.Tensor, options: WeightOnlyOptions) -> None:
        self.shape = tuple(weight.shape)
        self.dtype = weight.dtype
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        self._finish(torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous(),
                     scale.to(weight.dtype), options)

    def _finish(self, qweight: torch.Tensor, scale: torch.Tensor, options: WeightOnlyOptions) -> None:
        self.qweight = qweight
        self.scale = scale
        kernels = quant_kernels.load() if options.avx512_kernel else None
        self.kernel = kernels.int8_gemm if kernels and quant_kernels.supports_int8(self.shape, self.dtype) else None
        self._init_dense(options, self.dtype)

    def cache_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """What ``restore_int8`` rebuilds this weight from (the packed-weight cache)."""
        return {"qweight": self.qweight, "scale": self.scale}, {}

    @classmethod
    def restore(cls, tensors: dict[str, torch.Tensor], options: WeightOnlyOptions) -> Int8Weight:
        self = cls.__new__(cls)
        self.shape = tuple(tensors["qweight"].shape)
        self.dtype = tensors["scale"].dtype
        self._finish(tensors["qweight"], tensors["scale"], options)
        return self

    def _quantized_linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            if x.dtype == self.dtype and not torch.compiler.is_compiling():  # eager: the direct call
                return self.kernel(x, self.qweight, self.scale)
            return quant_kernels.int8_gemm(x.to(self.dtype), self.qweight, self.scale).to(x.dtype)
        return torch._weight_int8pack_mm(x.contiguous(), self.qweight, self.scale)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight[ids].to(self.dtype) * self.scale[ids].unsqueeze(-1)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.to(self.dtype) * self.scale.unsqueeze(-1)

    def nbytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * self.dtype.itemsize + self._dense_bytes()


def int4_group_codes(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization of ``weight [N, K]``: ``(codes int32 0..15 [N, K],
    scale [N, K/G], offset [N, K/G])`` with ``W ~ scale * code + offset`` (float32)."""
    n, k = weight.shape
    w = weight.float().view(n, k // group_size, group_size)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = (hi - lo) / 15.0
    safe = torch.where(scale == 0, 1.0, scale)
    codes = torch.round((w - lo.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp(0, 15).to(torch.int32)
    return codes.view(n, k), scale, lo


class Int4Weight(_DenseFallback):
    """``W[n, k] = (code - 8) * s[g, n] + z[g, n]`` with ``g = k // group_size``; from block
    scales ``scale * code + offset``: ``s = scale``, ``z = offset + 8 * scale`` (both rounded to
    the model's dtype). Two layouts: ``paged.plugins.quant_kernels``'s (bfloat16 on CPUs with
    AVX-512 BF16: ``packed``, scales and zeros inside its rows) or torch's (``packed``,
    ``scales_and_zeros``)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group_size: int,
                 dtype: torch.dtype, options: Int4Options) -> None:
        self.shape = tuple(codes.shape)
        self.dtype = dtype
        self.group_size = group_size
        s = scale.float().to(dtype)
        z = (offset.float() + 8.0 * scale.float()).to(dtype)
        self._find_kernel(options)
        self.scales_and_zeros: torch.Tensor | None = None
        if self.kernel is not None:
            self.packed = quant_kernels.pack(codes, s, z, group_size)
        else:
            self.packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
            self.scales_and_zeros = torch.stack([s.t(), z.t()], dim=-1).contiguous()
        # the dense copy from the codes at hand: what dequantize() computes, without reading the
        # codes back out of the packed layout (a second or so of a start-up without the cache)
        self._init_dense(options, dtype, lambda: self._dequantize_codes(codes, s, z))

    def _find_kernel(self, options: Int4Options) -> None:
        kernels = quant_kernels.load() if options.avx512_kernel else None
        ok = kernels is not None and quant_kernels.supports_int4(self.shape, self.group_size, self.dtype)
        self.kernel = kernels.int4_gemm if ok else None

    def _layout(self) -> str:
        return "paged" if self.kernel is not None else "torch"

    def cache_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """What ``restore`` rebuilds this weight from (the packed-weight cache): the packed
        codes in this process's layout and, when there is a dense copy, its values (the
        dequantization a start-up would otherwise compute again)."""
        tensors = {"packed": self.packed}
        if self.scales_and_zeros is not None:
            tensors["scales_and_zeros"] = self.scales_and_zeros
        if self.dense is not None or self.packed_dense is not None:
            tensors["dense"] = self.dense if self.dense is not None else self.dequantize()
        meta = {"layout": self._layout(), "shape": json.dumps(self.shape), "group_size": str(self.group_size),
                "dtype": str(self.dtype).removeprefix("torch.")}
        return tensors, meta

    @classmethod
    def restore(cls, tensors: dict[str, torch.Tensor], meta: dict[str, str], options: Int4Options) -> Int4Weight | None:
        """The weight ``cache_tensors`` stored, or None when it was packed for the other layout."""
        self = cls.__new__(cls)
        self.shape = tuple(json.loads(meta["shape"]))
        self.dtype = getattr(torch, meta["dtype"])
        self.group_size = int(meta["group_size"])
        self._find_kernel(options)
        if meta["layout"] != self._layout() or (options.dense_copy and "dense" not in tensors):
            return None
        self.packed = tensors["packed"]
        self.scales_and_zeros = tensors.get("scales_and_zeros")
        dense = tensors.get("dense")
        self._init_dense(options, self.dtype, lambda: dense)
        return self

    def _quantized_linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            if x.dtype == self.dtype and not torch.compiler.is_compiling():  # eager: the direct call
                return self.kernel(x, self.packed)
            return quant_kernels.int4_gemm(x.to(self.dtype), self.packed).to(x.dtype)
        return torch._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.group_size, self.scales_and_zeros)

    def codes(self, ids: torch.Tensor) -> torch.Tensor:
        """The int4 codes of rows ``ids`` (int32 ``[T, K]``), read back from the packed layout."""
        if self.kernel is not None:
            return quant_kernels.unpack(self.packed[ids], self.shape[1])
        blocks = self.packed.view(self.shape[0] // _PACK_ROWS, self.shape[1], _PACK_ROWS // 2)
        j = ids % _PACK_ROWS
        raw = blocks[ids // _PACK_ROWS, :, j % (_PACK_ROWS // 2)]  # [T, K]
        return torch.where((j >= _PACK_ROWS // 2).unsqueeze(-1), raw >> 4, raw & 15).to(torch.int32)

    def scale_zero(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s, z)`` of rows ``ids``, ``[T, K/group_size]`` each, in the model's dtype."""
        if self.kernel is not None:
            step = self.group_size // quant_kernels.SUB
            s, z = quant_kernels.scales_and_zeros(self.packed[ids], self.shape[1])
            return s[:, ::step], z[:, ::step]
        sz = self.scales_and_zeros[:, ids]
        return sz[..., 0].t(), sz[..., 1].t()

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        return self._dequantize_codes(self.codes(ids), *self.scale_zero(ids))

    def dequantize(self) -> torch.Tensor:
        return self.embedding(torch.arange(self.shape[0]))

    def _dequantize_codes(self, codes: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Rows ``(code - 8) * s + z`` from unpacked ``codes [T, K]`` and their scales and zeros
        ``s, z [T, K/G]``, in the activation dtype as the kernels compute."""
        t, k = codes.shape
        q = (codes.to(torch.int32) - 8).to(self.dtype).view(t, k // self.group_size, self.group_size)
        return (q * s.unsqueeze(-1) + z.unsqueeze(-1)).view(t, k)

    def nbytes(self) -> int:
        scales = 0 if self.scales_and_zeros is None else self.scales_and_zeros.numel() * self.dtype.itemsize
        return self.packed.numel() + scales + self._dense_bytes()


def quantize_int8(weight: torch.Tensor, scales: BlockScales | None, options: WeightOnlyOptions | None) -> Int8Weight:
    """Per-channel int8. A GGUF ``Q8_0`` weight (one scale per 32 inputs) is requantized from
    its exact values with one scale per row: the kernel has no per-block scales."""
    return Int8Weight(weight, options or WeightOnlyOptions())


def restore_int8(tensors: dict[str, torch.Tensor], meta: dict[str, str], options: WeightOnlyOptions | None) -> Int8Weight:
    return Int8Weight.restore(tensors, options or WeightOnlyOptions())


def restore_int4(tensors: dict[str, torch.Tensor], meta: dict[str, str], options: Int4Options | None) -> Int4Weight | None:
    return Int4Weight.restore(tensors, meta, options or Int4Options())


def quantize_int4(weight: torch.Tensor, scales: BlockScales | None, options: Int4Options | None) -> Int4Weight | None:
    """Group-wise int4; ``Q4_0``/``Q4_1`` block scales (blocks of 32) are kept as they are when
    ``group_size`` is 32. None (the weight stays dense) where the packed layout cannot hold
    the shape (rows not a multiple of 64, inputs not a multiple of the group)."""
    options = options or Int4Options()
    n, k = weight.shape
    if n % _PACK_ROWS or k % options.group_size:
        return None
    if scales is not None and scales.kind in ("q4_0", "q4_1") and scales.block == options.group_size:
        codes, scale, offset = scales.codes(weight), scales.scale, scales.offset
    else:
        codes, scale, offset = int4_group_codes(weight, options.group_size)
    return Int4Weight(codes, scale, offset, options.group_size, weight.dtype, options)


@hookimpl
def register_quantization_methods():
    # the packed-weight cache's layout: bump the number when cache_tensors/restore change; the
    # kernel library's build name follows its source (and with it the packed layout)
    kernels = quant_kernels.build_name()
    return [
        QuantizationMethodSpec(
            "gguf", gguf_quantization.quantize_gguf, gguf_quantization.GGUFOptions,
            "a GGUF's blocks as stored (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, Q2_K-Q6_K), every batch size, no dense copy",
            gguf_quantization._cpu_only, keeps=tuple(gguf_blocks.TYPES), restore=gguf_quantization.restore_gguf,
            cache_version=f"gguf-1:{gguf_kernels.build_name()}",
        ),
        QuantizationMethodSpec(
            "int8", quantize_int8, WeightOnlyOptions,
            "int8 per output channel (aten._weight_int8pack_mm); GGUF Q8_0 requantized per channel",
            _cpu_only, keeps=("q8_0",), restore=restore_int8, cache_version=f"int8-1:{kernels}",
        ),
        QuantizationMethodSpec(
            "int4", quantize_int4, Int4Options,
            "int4 in groups of 32 input features (aten._weight_int4pack_mm_for_cpu); keeps GGUF Q4_0/Q4_1",
            _cpu_only, keeps=("q4_0", "q4_1"), restore=restore_int4, cache_version=f"int4-1:{kernels}",
        ),
    ]
