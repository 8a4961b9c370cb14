"""Native CPU kernels: build a C++ source into a library of torch ops, once per machine.

Used by ``paged.backends.cpu_paged_decode`` (paged-decode attention, KV write),
``paged.models.cpu_layer_ops`` (fused norm, rotary, SiLU-and-mul) and
``paged.plugins.quant_kernels`` (int4 GEMM). ``build_and_load`` compiles a source with
``torch.utils.cpp_extension.load_inline`` into the torch extensions directory
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) and imports it. A source
exposes its kernels as a Python module (``PYBIND11_MODULE``: what eager code calls, ~0.15 us a
call) and, where ``torch.compile`` must see them, also as torch ops (``TORCH_LIBRARY``,
``torch.ops.<namespace>.<name>``; a call through the dispatcher costs ~1.7 us, and a decode step
makes ~300 of them). This needs a C++ compiler and ninja (a dependency of the package). The build's name carries a hash of the source, the flags, the torch version and the
CPU's feature flags, so a cached build is never loaded by a different torch or on a CPU it was
not compiled for (``-march=native``). Only the headers a source needs are included
(``torch/python.h`` for the bindings, not ``torch/extension.h``, which alone takes ~30 s to
parse): a first build takes 10-20 s, later processes load the cached library. ``native_vec.h``
(16-lane fp32 vectors and their loads) is put before every source.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from pathlib import Path
from types import ModuleType

import torch

CFLAGS = ["-O3", "-march=native", "-fopenmp", "-Wno-psabi"]  # psabi: GCC's notes on 64-byte vectors

_STALE_LOCK_S = 300  # a build takes well under a minute


VEC_HEADER = (Path(__file__).parent / "native_vec.h").read_text()  # put before every source


def build_name(prefix: str, source: str, cflags: list[str]) -> str:
    """``prefix`` + a hash of the source, flags, torch version and the CPU's feature flags."""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    key = "\0".join([VEC_HEADER, source, " ".join(cflags), torch.__version__, cpu])
    return prefix + hashlib.sha256(key.encode()).hexdigest()[:12]


def ensure_ninja() -> None:
    """torch calls ``ninja`` from PATH; the pip package ``ninja`` puts it in the venv's bin, which
    is not on PATH when the interpreter is run as ``.venv/bin/python`` without activation."""
    if shutil.which("ninja") is None:
        import ninja  # raises ImportError: reported by the caller as "unavailable"

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def build_directory(name: str) -> str:
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


def build_and_load(name: str, source: str, cflags: list[str], what: str, logger: logging.Logger) -> ModuleType:
    """Compile ``source`` as ``name`` (see ``build_name``) unless a build is cached, load it and
    return it as a Python module. ``what`` names the kernels in the log: the first build is
    announced before it starts (a first start pauses) and timed after. Raises whatever the build
    or the load raises."""
    from torch.utils import cpp_extension

    ensure_ninja()
    directory = build_directory(name)
    built = os.path.exists(os.path.join(directory, f"{name}.so"))
    if not built:
        logger.info("compiling the %s (once per machine and torch version, usually 10-60 s) into %s", what, directory)
    start = time.perf_counter()
    module = cpp_extension.load_inline(
        name,
        cpp_sources=VEC_HEADER + source,
        extra_cflags=cflags,
        extra_ldflags=["-fopenmp"],  # libgomp: resolves to the copy torch has already loaded
        build_directory=directory,
        no_implicit_headers=True,
        is_python_module=True,
    )
    elapsed = time.perf_counter() - start
    if built:
        logger.debug("%s loaded in %.1f s", what, elapsed)
    else:
        logger.info("compiled the %s in %.1f s", what, elapsed)
    return module
