"""An int4 x bfloat16 GEMM for decode-sized batches on CPUs with AVX-512 BF16 (C++, built on
first use), used by the bundled ``int4`` method (``paged.plugins.quantization``).

Why: ``aten._weight_int4pack_mm_for_cpu`` widens every code to fp32 and multiplies-adds per
weight; on this 2-core AVX-512 machine it is bound by that arithmetic when the weights are in
cache and reads them from memory at ~30 GB/s. Here a code becomes a bf16 number in one or two
integer instructions and ``vdpbf16ps`` multiplies-adds 32 weights per instruction: 1.3x faster
in cache, ~1.1x streaming the default model's weights from memory, a 1.06-1.10x shorter batch-1
decode step (``python benchmarks/int4_gemm.py``; same-run A/B in the README).

Layout, row-major (a row's bytes are contiguous, so each thread streams one run of memory)::

    packed [N, K/2] uint8: per 64 inputs of a row, 32 bytes; byte j holds the code of input
                           j (low nibble) and of input 32 + j (high nibble)
    scales, zeros [N, K/32] bfloat16: per 32 inputs of a row

with ``W[n, k] = (code - 8) * scale + zero`` (the int4 method's formula; a group of more than
32 inputs repeats its scale and zero). Arithmetic: ``bits(bf16 128.0) | code`` is the bf16
number ``128 + code`` (exact: 7 mantissa bits), so per 32-input half ``g`` the kernel takes
``d_g = sum (128 + code) * x`` (``vdpbf16ps``, fp32 accumulation) and a row's output is
``sum_g scale_g * d_g + sum_g (zero_g - 136 * scale_g) * sum_{k in g} x_k``, rounded once to
bfloat16 (the 128 offset costs 7 of fp32's 24 bits in the partial sums, far below the bf16
rounding of the result). Four output rows are computed together (independent FMA chains; a
chunk's two scales come in one broadcast load) with a software prefetch a few rows ahead; rows
of ``x`` are taken four at a time (more rows: further passes, the weights then come from L2).

``load()`` returns the kernel ``(x [M, K] bf16, packed, scales, zeros) -> [M, N] bf16`` or
``None`` (after one warning) where it cannot be built, or the CPU lacks AVX-512 BF16 (then the
int4 method keeps torch's kernel and layout). Under ``torch.compile`` it is the opaque op
``torch.ops.paged_int4.int4_gemm`` (``int4_gemm``; a fake implementation gives its shape).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import torch

from paged.core import native

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_suffix(".cpp").read_text()
_CFLAGS = native.CFLAGS

CHUNK = 64  # inputs per 32 packed bytes: K must be a multiple
SUB = 32  # inputs per scale/zero entry: the group size must be a multiple


@functools.cache
def load() -> Any | None:
    """``torch.ops.paged_int4.int4_gemm``, built on first use; ``None`` where it cannot run here."""
    try:
        name = native.build_name("paged_int4_", _SOURCE, _CFLAGS)
        module = native.build_and_load(name, _SOURCE, _CFLAGS, "CPU int4 kernel", logger)
    except Exception as e:  # noqa: BLE001 -- no compiler, no ninja, unwritable cache, ...: never fatal
        logger.warning("CPU int4 kernel unavailable, int4 weights use torch's kernel instead: %s", e)
        return None
    if not module.available():
        logger.info("CPU int4 kernel: this CPU has no AVX-512 BF16; int4 weights use torch's kernel")
        return None

    @torch.library.register_fake("paged_int4::int4_gemm")
    def _fake(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], packed.shape[0])

    return module.int4_gemm


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The kernel as the torch op (what ``torch.compile`` traces; eager callers use ``load()``'s)."""
    return torch.ops.paged_int4.int4_gemm(x, packed, scales, zeros)


def supports(shape: tuple[int, int], group_size: int, dtype: torch.dtype) -> bool:
    """Whether a weight of ``shape`` ``[N, K]`` in groups of ``group_size`` can use the kernel."""
    return dtype == torch.bfloat16 and shape[1] % CHUNK == 0 and group_size % SUB == 0


def pack(codes: torch.Tensor) -> torch.Tensor:
    """``codes`` int ``[N, K]`` in 0..15 -> ``packed [N, K/2]`` uint8 (the layout above)."""
    n, k = codes.shape
    halves = codes.to(torch.uint8).view(n, k // CHUNK, 2, CHUNK // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """``packed [T, K/2]`` -> codes int32 ``[T, K]`` (the inverse of ``pack``)."""
    t, half = packed.shape
    chunks = packed.view(t, half // (CHUNK // 2), CHUNK // 2)
    return torch.cat([chunks & 15, chunks >> 4], dim=-1).reshape(t, 2 * half).to(torch.int32)


def expand_groups(scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``scale`` and ``zero`` ``[N, K/group_size]`` (bfloat16 values) -> the kernel's
    ``scales`` and ``zeros``, ``[N, K/32]`` bfloat16."""
    repeat = group_size // SUB
    return (scale.repeat_interleave(repeat, 1).to(torch.bfloat16).contiguous(),
            zero.repeat_interleave(repeat, 1).to(torch.bfloat16).contiguous())
