"""The C++ LoRA kernel for the CPU (``lora_kernels.cpp``; built once per machine: by ``.ci/setup``,
else on first use, with ``paged.core.native``).

    lora_apply(y [T, out], x [T, in], a [S, R, in], b [S, R, out], token_slots [T] int32,
               ranks [S] int32, parts) -> None

adds ``(a[s] @ x[t]) @ b[s]`` to ``y[t]`` for each row ``t`` with ``s = token_slots[t] >= 0``
(``paged.core.lora``'s layout: ``R = parts * max_rank``; only rows ``[p * max_rank, p * max_rank +
ranks[s])`` of each part are read, so a rank-8 adapter in rank-64 slots costs rank 8). Per row: R
dot products over ``in`` and R scaled adds over ``out`` in fp32 (16 lanes at a time), then one
rounding of ``y + delta`` to the dtype. Rows run in parallel (a few rows on the calling thread).
float32, bfloat16 and float16.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from paged.core import native

logger = logging.getLogger(__name__)

_SOURCE = native.read_source(Path(__file__).with_suffix(".cpp"))
_CFLAGS = native.CFLAGS


def build_name() -> str:
    """The library's name in the build folder (``paged.core.native.build_name``)."""
    return native.build_name("paged_lora_", _SOURCE, _CFLAGS)


@functools.cache
def load() -> Any | None:
    """The kernel as a Python module, loaded (built if need be) on first use; None with one
    warning when it cannot be built or loaded."""
    try:
        return native.build_and_load(build_name(), _SOURCE, _CFLAGS, "LoRA kernel", logger)
    except Exception as e:  # noqa: BLE001 -- no compiler, no ninja, unwritable cache, ...: never fatal
        logger.warning("the C++ LoRA kernel is unavailable (lora.kernel=torch works everywhere): %s", e)
        return None
