"""glibc malloc settings for a process that runs the model on the CPU.

A forward pass allocates and frees the same activations every layer and step: a 2,048-token
prefill step of the default model makes 12 MiB outputs. glibc serves a block that large with a
fresh ``mmap`` (above ``M_MMAP_THRESHOLD``, which it raises only up to 32 MiB, and only after such
a block is freed) and gives freed heap memory back to the system once ``M_TRIM_THRESHOLD`` of it
sits at the top. Either way the next step first-touches new pages: on a 2-core Xeon VM
2,048-token steps took 22,000-140,000 page faults and up to 130 ms more than the 430-450 ms of a
step without them. vLLM preloads tcmalloc for the same reason; paged keeps glibc and tells it to
keep freed memory: blocks under ``MMAP_THRESHOLD`` come from the heap, and up to
``TRIM_THRESHOLD`` of free heap stays with the process. Memory held stays at the peak of a step's
activations (the weights and the KV cache are allocated once and do not change).

Left alone where the user chose: ``MALLOC_ARENA_MAX`` or a ``MALLOC_*_`` threshold variable,
``GLIBC_TUNABLES`` with malloc settings, or another allocator in ``LD_PRELOAD`` (tcmalloc,
jemalloc, mimalloc). ``LLM`` runs its engine core in the caller's process, so the caller's malloc
gets these settings too.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

logger = logging.getLogger("paged")

# mallopt's parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 256 * 2**20  # larger than any activation of a 2,048-token step of a 7B model's shapes
OLD_GLIBC_MMAP_THRESHOLD = 32 * 2**20  # the most that older glibc accepts (half its heap size)
TRIM_THRESHOLD = 1024 * 2**20
TOP_PAD = 64 * 2**20  # the heap grows in steps this large (fewer brk calls while it reaches its peak)

_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")


def user_chose_allocator(environ: dict[str, str] | os._Environ = os.environ) -> str | None:
    """What in the environment already decides malloc's behaviour, or None."""
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX"):
        if name in environ:
            return name
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    preload = environ.get("LD_PRELOAD", "")
    for allocator in _ALLOCATORS:
        if allocator in preload:
            return f"LD_PRELOAD ({allocator})"
    return None


def keep_freed_memory() -> bool:
    """Set glibc's thresholds as above in this process; True where all three took. False, with
    nothing changed, where the user chose otherwise or the C library is not glibc. An older glibc
    refuses an mmap threshold above 32 MiB (half its heap size): it then gets 32 MiB, and False."""
    if user_chose_allocator() is not None or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 -- only glibc has it (musl: leave malloc be)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    mmap_set = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    if not mmap_set:
        mallopt(M_MMAP_THRESHOLD, OLD_GLIBC_MMAP_THRESHOLD)
    trim_set = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    pad_set = mallopt(M_TOP_PAD, TOP_PAD) == 1
    if not (mmap_set and trim_set and pad_set):
        logger.debug("glibc's mallopt refused some of paged's settings (mmap threshold %s, trim %s, top pad %s)",
                     mmap_set, trim_set, pad_set)
    return mmap_set and trim_set and pad_set
