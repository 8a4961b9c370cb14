"""glibc malloc settings for a process that runs the model on the CPU.

A forward pass allocates and frees the same activations every layer and step: a 2,048-token
prefill step of the default model makes 12 MiB outputs. glibc serves a block that large with a
fresh ``mmap`` (above ``M_MMAP_THRESHOLD``, which it raises only up to 32 MiB, and only after such
a block is freed) and gives freed heap memory back to the system once ``M_TRIM_THRESHOLD`` of it
sits at the top. Either way the next step first-touches new pages: on a 2-core Xeon VM some
2,048-token steps took 50,000-140,000 page faults and 100-150 ms more than the 420-440 ms of a
step without them. vLLM preloads tcmalloc for the same reason; paged keeps glibc and tells it to
keep freed memory: blocks under ``MMAP_THRESHOLD`` come from the heap, and up to
``TRIM_THRESHOLD`` of free heap stays with the process. Memory held stays at the peak of a step's
activations (the weights and the KV cache are allocated once and do not change).

Left alone where the user chose: ``MALLOC_*_`` variables, ``GLIBC_TUNABLES`` with malloc
settings, or another allocator in ``LD_PRELOAD`` (tcmalloc, jemalloc, mimalloc).
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger("paged")

# mallopt's parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 256 * 2**20  # larger than any activation of a 2,048-token step of a 7B model's shapes
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
    """Set glibc's thresholds as above in this process; False (and nothing changed) where the user
    chose otherwise or the C library is not glibc."""
    if user_chose_allocator() is not None:
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 -- only glibc has it (musl, macOS: leave malloc be)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    done = all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
    if not done:
        logger.debug("glibc's mallopt refused paged's thresholds; malloc keeps its defaults")
    return done
