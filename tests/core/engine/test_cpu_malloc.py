"""glibc keeps the memory a CPU step frees (paged.core.engine.cpu_malloc): a block the size of a
prefill step's activations, freed and allocated again, is not faulted in again."""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from paged.core.engine.cpu_malloc import user_chose_allocator

# A 48 MiB block (above the 32 MiB that glibc's own threshold ever reaches) allocated, written and
# freed three times with the settings on; prints the page faults of the last two rounds (24,578 on
# a 2-core Xeon VM with glibc's defaults: each round's block a fresh mmap).
_ROUNDS = textwrap.dedent("""
    import ctypes, resource
    from paged.core.engine.cpu_malloc import keep_freed_memory
    if not keep_freed_memory():
        raise SystemExit(print("refused"))
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 48 * 2**20
    faults = []
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        libc.free(block)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(faults[1] + faults[2])
""")


def _run(script: str) -> str:
    """``script`` in a fresh interpreter, without the caller's malloc choices; its last word.
    Skips the test where this glibc refuses the settings (an older one: a 256 MiB mmap threshold)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("LD_PRELOAD", "GLIBC_TUNABLES")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    if done.stdout.split()[-1] == "refused":
        pytest.skip("this glibc refuses paged's malloc settings")
    return done.stdout.split()[-1]


needs_glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                                 reason="glibc's mallopt")


@needs_glibc
def test_a_freed_block_is_reused_without_new_page_faults():
    pages = 48 * 2**20 // os.sysconf("SC_PAGE_SIZE")
    kept = int(_run(_ROUNDS))
    assert kept < pages // 20, f"{kept} page faults re-touching a freed 48 MiB block ({pages} pages)"


def test_the_users_choice_of_allocator_is_left_alone():
    assert user_chose_allocator({}) is None
    assert user_chose_allocator({"LD_PRELOAD": "", "GLIBC_TUNABLES": "glibc.rtld.nns=2"}) is None
    assert user_chose_allocator({"MALLOC_ARENA_MAX": "2"}) == "MALLOC_ARENA_MAX"
    assert user_chose_allocator({"MALLOC_TRIM_THRESHOLD_": "0"}) == "MALLOC_TRIM_THRESHOLD_"
    assert user_chose_allocator({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}) == "GLIBC_TUNABLES"
    assert user_chose_allocator({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}) == "LD_PRELOAD (tcmalloc)"
    assert user_chose_allocator({"LD_PRELOAD": "libjemalloc.so.2"}) == "LD_PRELOAD (jemalloc)"


def test_only_a_process_that_runs_the_model_on_the_cpu_sets_malloc(monkeypatch):
    import torch

    from paged.core.config import load_config
    from paged.core.engine import tp_ranks

    calls = []
    monkeypatch.setattr(tp_ranks, "keep_freed_memory", lambda: calls.append("kept") or True)
    config = load_config()
    tp_ranks.configure_cpu_process(config, torch.device("meta"))  # not the CPU (as a GPU rank)
    assert calls == []
    tp_ranks.configure_cpu_process(config, torch.device("cpu"))
    assert calls == ["kept"]


# With the settings on, the KV cache (zeros_untouched: one tensor per layer for K and one for V,
# 17 MiB each for the default model) must still cost no memory until written. From numpy's
# calloc, under the new mmap threshold, 60 such blocks were resident at once (947 MiB).
# Prints the resident growth in MiB.
_KV_CACHE = textwrap.dedent("""
    import os
    import torch
    from paged.core.engine.cpu_malloc import keep_freed_memory
    from paged.core.tensors import zeros_untouched
    if not keep_freed_memory():
        raise SystemExit(print("refused"))

    def resident():
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    before = resident()
    layers = [zeros_untouched((1088, 8192), torch.bfloat16, "cpu") for _ in range(8)]  # 17 MiB each
    grown = resident() - before
    assert all(cache[::7, ::1021].abs().sum().item() == 0 for cache in layers)
    layers[3][5, 9] = 1.5
    assert sum(cache.sum().item() for cache in layers) == 1.5
    print(grown)
""")


@needs_glibc
def test_the_kv_cache_costs_no_memory_until_written_with_the_settings_on():
    grown = float(_run(_KV_CACHE))
    assert grown < 8, f"{grown} MiB resident for unwritten caches of 136 MiB"


def _vm_flags_of(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE") or not os.path.isdir("/sys/kernel/mm/transparent_hugepage"),
                    reason="transparent huge pages (Linux)")
def test_the_kv_cache_is_not_advised_into_huge_pages():
    """numpy advises its large arrays into huge pages (VmFlags ``hg``), whose first faults may
    compact memory (3 s for 300 MiB on a 2-core VM, against 0.1 s in 4 KiB pages)."""
    import torch

    from paged.core.tensors import zeros_untouched

    middle = 1088 * 8192  # bytes: the middle of each 17 MiB block (advice covers whole pages)
    cache = zeros_untouched((1088, 8192), torch.bfloat16, "cpu")
    assert "hg" not in _vm_flags_of(cache.data_ptr() + middle)
    assert cache.count_nonzero().item() == 0
    # the reference: memory advised as numpy advises its large arrays shows the flag
    advised = mmap.mmap(-1, 4 * 2**20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advised.madvise(mmap.MADV_HUGEPAGE)
    holder = ctypes.c_char.from_buffer(advised)
    assert "hg" in _vm_flags_of(ctypes.addressof(holder) + 2**21)
    del holder
