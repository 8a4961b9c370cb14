"""Fused CPU kernels for the elementwise layers: RMSNorm (with its residual add), rotary
embedding, SiLU-and-mul, GELU-tanh-and-mul (C++, built once per machine: by ``.ci/setup``, else on first use).

Why: at batch 1 a decode step's weights are read in ~4 ms on this 2-core machine, and eager
PyTorch spent as long again dispatching the ~80 small ops per layer around them: RMSNorm alone
is ten ops (add, float, pow, mean, add, rsqrt, mul, to, mul), rotary another twelve. Each fused
op here is one call, computes in fp32 and rounds to the tensor's dtype exactly where the eager
chain rounds, so it returns the eager values (RMSNorm's sum of squares may differ in the last
bit of fp32: the summation order is its own).

    rms_norm(x [..., N], weight [N], eps) -> out
    add_rms_norm(x, residual, weight, eps) -> (out, x + residual)    # inputs left unchanged
    gemma_rms_norm / gemma_add_rms_norm: the same with a float32 weight (Gemma's 1 + w) applied
        before the one rounding (HF's Gemma norm)
    rotary(q [T, H, D], k [T, Hkv, D], cos, sin [T, (1,) D/2]) -> (q', k')   # neox rotate-half
    silu_and_mul(x [T, 2I]) -> silu(x[:, :I]) * x[:, I:]
    gelu_tanh_and_mul(x [T, 2I]) -> gelu_tanh(x[:, :I]) * x[:, I:]   # Gemma's GeGLU

and ``DecoderPlan``: a decode step's decoder layers as one C++ call (``paged.models.direct_decoder``
builds it; the GGUF products and the paged-decode attention come in as capsules of their
libraries' C++ functions, ``gemm_capsule`` and ``write_and_decode[_grouped]_capsule``).

float32, bfloat16 and float16 CPU tensors. ``paged.models.layers`` calls them for CPU tensors in
eager mode (``enabled``); under ``torch.compile`` inductor fuses the torch ops itself. Built with
``paged.core.native`` (once per machine and torch version; ``-ffp-contract=off`` so fp32
products are rounded as torch rounds them). ``load()`` returns ``None`` after one warning when
the build fails, and the layers keep their torch ops; ``PAGED_CPU_LAYER_OPS=0`` turns the
kernels off (A/B measurements, debugging).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

import torch

from paged.core import native

logger = logging.getLogger(__name__)

_SOURCE = native.read_source(Path(__file__).with_suffix(".cpp"))
_CFLAGS = [*native.CFLAGS, "-ffp-contract=off"]


def build_name() -> str:
    """The library's name in the build folder (``paged.core.native.build_name``)."""
    return native.build_name("paged_cpu_layers_", _SOURCE, _CFLAGS)


@functools.cache
def load() -> Any | None:
    """The kernels above as a Python module (no torch ops: only eager code calls them),
    loaded (built if need be) on first use; ``None`` with one warning per process if they cannot be built or loaded,
    or when ``PAGED_CPU_LAYER_OPS=0``."""
    if os.environ.get("PAGED_CPU_LAYER_OPS", "1") == "0":
        return None
    try:
        return native.build_and_load(build_name(), _SOURCE, _CFLAGS, "CPU layer kernels", logger)
    except Exception as e:  # noqa: BLE001 -- no compiler, no ninja, unwritable cache, ...: never fatal
        logger.warning("CPU layer kernels unavailable, the layers run their torch ops instead: %s", e)
        return None


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def enabled(x: torch.Tensor) -> Any | None:
    """The ops when ``x`` should go through them: a CPU tensor of a dtype they compute, eager
    (not being traced by ``torch.compile``), and the kernels built. Callers also check what their
    op needs of the other inputs (same dtype and shape, no broadcasting) and otherwise keep their
    torch ops, which accept more."""
    if not x.is_cpu or x.dtype not in _DTYPES or torch.compiler.is_compiling():
        return None
    return load()
