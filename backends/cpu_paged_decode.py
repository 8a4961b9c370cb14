"""A fused paged-decode attention kernel for the CPU (C++, built on first use).

Why: the torch backend's decode path gathers every request's K/V blocks into a contiguous buffer
(``index_select``) and then runs SDPA over it, so each layer writes a full copy of the batch's
context before reading it again; on a 2-core CPU that gather is as expensive as the attention
itself. This kernel reads the K/V rows straight from the paged cache through the block table.

``paged_decode(q, k_cache, v_cache, block_table, seq_lens, scale, out)``, one query token per
request (``b`` in ``0..B-1``)::

    q, out       [B, H, D]       the cache's dtype; any strides with a contiguous last dim
    k/v_cache    [num_blocks, block_size, Hkv, D] contiguous; float32, bfloat16 or float16
    block_table  [B, >= cdiv(seq_lens[b], block_size)] int32 (rows may be strided)
    seq_lens     [B] int32, >= 1: request b attends over its positions 0 .. seq_lens[b] - 1

Design. Work items are whole requests (or, when there are fewer than 2 per thread, (request, KV
head) pairs, so that batch 1 still uses every core), handed to the threads dynamically (contexts
are ragged). An item walks its positions ``TILE`` (64) at a time; a tile may span several blocks,
so block size 1 costs nothing extra. Per tile and KV head, the ``G = H / Hkv`` query heads that
share the KV head are processed one after the other while the tile's K/V rows are hot in L1 (a
bf16/fp16 tile is widened to fp32 once, into per-thread scratch, not once per query head): the
tile's scores and their max, one online-softmax update (running max and sum; the accumulator is
rescaled once per tile, not once per key), then the tile's V rows weighted into the fp32
accumulator. Reading every KV head of a tile together makes each block one contiguous run of
memory, which the hardware prefetchers follow. Only positions below ``seq_len`` are ever read, so
padding entries of the block table and the stale tail of the last block (NaN in the tests) never
enter the sums. Scores, softmax and accumulation are fp32 whatever the cache dtype; the output is
rounded once at the end. The inner loops use 16-lane GCC/Clang vector types (plain loops over a
64-long head dim vectorized poorly: serial horizontal sums, spilled accumulators), and head dims
64 and 128 are compile-time constants; any other head dim works through the generic instance.

Threads: OpenMP with ``at::get_num_threads()`` threads (``torch.set_num_threads`` applies); the
library links libgomp, which resolves to the copy torch has loaded, so there is one thread pool.

Build: ``torch.utils.cpp_extension.load_inline`` with ``-O3 -march=native -fopenmp`` into the
torch extensions directory (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``),
which needs a C++ compiler and ninja (a dependency of the package). The name of the build carries
a hash of the source, the flags, the torch version and the CPU's feature flags, so a cached build
is never loaded by a different torch or on a CPU it was not compiled for. Only the few ATen and
dispatcher headers it needs are included (not ``torch/extension.h``, which alone takes ~30 s to
parse): the first build takes seconds, later processes load the cached library. ``load()`` returns
``None`` (after one warning) when the build or the load fails; the caller then keeps its own path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = (Path(__file__).with_suffix(".cpp")).read_text()  # the kernel, next to this loader

_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-Wno-psabi"]  # psabi: notes on 64-byte vectors


def _build_name() -> str:
    """Source, flags, torch and the CPU's features: a cached build for another CPU (``-march=native``)
    or another torch ABI is never picked up."""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    key = "\0".join([_SOURCE, " ".join(_CFLAGS), torch.__version__, cpu])
    return "paged_cpu_decode_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def _ensure_ninja() -> None:
    """torch calls ``ninja`` from PATH; the pip package ``ninja`` puts it in the venv's bin, which
    is not on PATH when the interpreter is run as ``.venv/bin/python`` without activation."""
    if shutil.which("ninja") is None:
        import ninja  # raises ImportError: reported as "unavailable" by load()

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


_STALE_LOCK_S = 300  # a build takes well under a minute


def _build_directory(name: str) -> str:
    """The build's folder under the torch extensions root. torch serialises concurrent builds
    with a ``lock`` file there and waits, without a timeout, for it to go; a build killed
    half-way (SIGKILL, a CI timeout) leaves it behind, so an old one is removed first."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    lock = os.path.join(path, "lock")
    while os.path.exists(lock):  # another process is building: wait for it, unless it died
        try:
            if time.time() - os.path.getmtime(lock) > _STALE_LOCK_S:
                os.remove(lock)
                break
        except FileNotFoundError:
            break
        time.sleep(0.2)
    return path


@functools.cache
def load() -> Callable[..., None] | None:
    """The kernel (``torch.ops.paged_cpu.paged_decode``), built on first use; ``None`` with one
    warning per process if it cannot be built or loaded."""
    try:
        from torch.utils import cpp_extension

        _ensure_ninja()
        name = _build_name()
        build_directory = _build_directory(name)
        built = os.path.exists(os.path.join(build_directory, f"{name}.so"))
        if not built:  # say why the first start pauses (the build is cached for later runs)
            logger.info("compiling the CPU paged-decode kernel (once per machine and torch version, "
                        "usually 10-60 s) into %s", build_directory)
        start = time.perf_counter()
        cpp_extension.load_inline(
            name,
            cpp_sources=_SOURCE,
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],  # libgomp: resolves to the copy torch has already loaded
            build_directory=build_directory,
            no_implicit_headers=True,
            is_python_module=False,  # loaded with torch.ops.load_library; the op registers itself
        )
        elapsed = time.perf_counter() - start
        if built:
            logger.debug("CPU paged-decode kernel loaded in %.1f s", elapsed)
        else:
            logger.info("compiled the CPU paged-decode kernel in %.1f s", elapsed)
        return torch.ops.paged_cpu.paged_decode
    except Exception as e:  # noqa: BLE001 -- no compiler, no ninja, unwritable cache, ...: never fatal
        logger.warning("CPU paged-decode kernel unavailable, the torch backend gathers K/V instead: %s", e)
        return None
