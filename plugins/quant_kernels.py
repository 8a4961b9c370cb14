"""int4 and int8 x bfloat16 GEMMs for decode-sized batches on CPUs with AVX-512 BF16 (C++,
built once per machine: by ``.ci/setup``, else on first use), used by the bundled ``int4`` and
``int8`` methods (``paged.plugins.quantization``).

Why: ``aten._weight_int4pack_mm_for_cpu`` widens every code to fp32 and multiplies-adds per
weight, and streams a decode step's weights from memory at ~25 GB/s on this 2-core machine (half
its copy bandwidth); ``aten._weight_int8pack_mm`` (the LM head) likewise. Here a code becomes a
bf16 number in one or two integer instructions, ``vdpbf16ps`` multiplies-adds 32 weights per
instruction, and each thread prefetches 8 KB ahead in its run of rows (a call is too short for
the hardware prefetchers to ramp up): the step's int4 weights stream at ~44 GB/s, 1.5x torch's
kernel, and 1.3-1.7x in cache (``python benchmarks/quant_gemm.py``).

int4 layout, row-major (a row's bytes are contiguous, so each thread streams one run of memory)::

    packed [N, K/2 + 4*K/32] uint8, per row: per 64 inputs 32 bytes, byte j holding the code
        of input j (low nibble) and of input 32 + j (high nibble); then the row's K/32 scales
        and its K/32 zeros, bfloat16 (in the row: in arrays of their own, scales and zeros made
        a decode step's weights ~15% slower to stream)

with ``W[n, k] = (code - 8) * scale + zero`` (the int4 method's formula; a group of more than
32 inputs repeats its scale and zero). Arithmetic: ``bits(bf16 128.0) | code`` is the bf16
number ``128 + code`` (exact: 7 mantissa bits), so per 32-input half ``g`` the kernel takes
``d_g = sum (128 + code) * x`` (``vdpbf16ps``, fp32 accumulation) and a row's output is
``sum_g scale_g * d_g + sum_g (zero_g - 136 * scale_g) * sum_{k in g} x_k``, rounded once to
bfloat16 (the 128 offset costs 7 of fp32's 24 bits in the partial sums, far below the bf16
rounding of the result).

int8: torch's layout, ``codes [N, K]`` int8 and ``scale [N]`` bfloat16 with ``W = scale * code``;
``u = code + 128`` split in nibbles ``u = 16 hi + lo``, each nibble a bf16 ``128 + nibble`` as
above, and ``sum code * x = 16 sum (128 + hi) x + sum (128 + lo) x - 2304 sum x``.

Both: four output rows are computed together (independent FMA chains; a
chunk's two scales come in one broadcast load) with a software prefetch a few rows ahead; rows
of ``x`` are taken four at a time (more rows: further passes, the weights then come from L2).

``load()`` returns the kernels, ``int4_gemm(x [M, K] bf16, packed) -> [M, N] bf16`` and
``int8_gemm(x, codes, scale)``, or ``None`` (after one warning) where they cannot be built, or
the CPU lacks AVX-512 BF16 (then the methods keep torch's kernels and layouts). Under
``torch.compile`` they are the opaque ops ``torch.ops.paged_quant.*`` (``int4_gemm``,
``int8_gemm`` here; fake implementations give their shapes).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import torch

from paged.core import native

logger = logging.getLogger(__name__)

_SOURCE = native.read_source(Path(__file__).with_suffix(".cpp"))
_CFLAGS = native.CFLAGS


def build_name() -> str:
    """The library's name in the build folder (``paged.core.native.build_name``)."""
    return native.build_name("paged_quant_", _SOURCE, _CFLAGS)

CHUNK = 64  # inputs per 32 packed bytes: K must be a multiple
SUB = 32  # inputs per scale/zero entry: the group size must be a multiple


@functools.cache
def load() -> Any | None:
    """The kernels as a Python module (``int4_gemm``, ``int8_gemm``), loaded (built if need be) on first use;
    ``None`` where they cannot run here."""
    try:
        module = native.build_and_load(build_name(), _SOURCE, _CFLAGS, "CPU int4/int8 kernels", logger)
    except Exception as e:  # noqa: BLE001 -- no compiler, no ninja, unwritable cache, ...: never fatal
        logger.warning("CPU int4/int8 kernels unavailable, quantized weights use torch's kernels instead: %s", e)
        return None
    if not module.available():
        logger.info("CPU int4/int8 kernels: this CPU has no AVX-512 BF16; quantized weights use torch's kernels")
        return None
    _register_fakes()
    return module


@functools.cache  # once per process: a second registration raises
def _register_fakes() -> None:
    @torch.library.register_fake("paged_quant::int4_gemm")
    def _fake_int4(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], packed.shape[0])

    @torch.library.register_fake("paged_quant::int8_gemm")
    def _fake_int8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], codes.shape[0])


def int4_gemm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """The int4 kernel as the torch op (what ``torch.compile`` traces; eager code calls ``load()``'s)."""
    return torch.ops.paged_quant.int4_gemm(x, packed)


def int8_gemm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The int8 kernel as the torch op (what ``torch.compile`` traces; eager code calls ``load()``'s)."""
    return torch.ops.paged_quant.int8_gemm(x, codes, scale)


def supports_int4(shape: tuple[int, int], group_size: int, dtype: torch.dtype) -> bool:
    """Whether an int4 weight of ``shape`` ``[N, K]`` in groups of ``group_size`` can use the kernel."""
    return dtype == torch.bfloat16 and shape[1] % CHUNK == 0 and group_size % SUB == 0


def supports_int8(shape: tuple[int, int], dtype: torch.dtype) -> bool:
    """Whether an int8 weight of ``shape`` ``[N, K]`` can use the kernel."""
    return dtype == torch.bfloat16 and shape[1] % SUB == 0


def row_bytes(k: int) -> int:
    """Bytes of one packed row of ``k`` inputs: the codes, then the scales, then the zeros."""
    return k // 2 + 4 * (k // SUB)


def pack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """``codes`` int ``[N, K]`` in 0..15 and per-row ``scale``, ``zero`` ``[N, K/group_size]``
    (bfloat16 values) -> ``packed [N, row_bytes(K)]`` uint8 (the layout above)."""
    n, k = codes.shape
    halves = codes.to(torch.uint8).view(n, k // CHUNK, 2, CHUNK // 2)
    nibbles = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2)
    repeat = group_size // SUB
    meta = torch.cat([scale.repeat_interleave(repeat, 1), zero.repeat_interleave(repeat, 1)], dim=1)
    return torch.cat([nibbles, meta.to(torch.bfloat16).contiguous().view(torch.uint8)], dim=1).contiguous()


def unpack(packed: torch.Tensor, k: int) -> torch.Tensor:
    """Rows of ``packed`` -> their codes, int32 ``[T, K]`` (the inverse of ``pack``)."""
    t = packed.shape[0]
    chunks = packed[:, : k // 2].reshape(t, k // CHUNK, CHUNK // 2)
    return torch.cat([chunks & 15, chunks >> 4], dim=-1).reshape(t, k).to(torch.int32)


def scales_and_zeros(packed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``packed`` -> their ``(scale, zero)``, bfloat16 ``[T, K/32]`` each."""
    meta = packed[:, k // 2 :].contiguous().view(torch.bfloat16)
    return meta[:, : k // SUB], meta[:, k // SUB :]
