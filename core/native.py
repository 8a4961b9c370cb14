"""Native CPU kernels: build a C++ source into a library of torch ops, once per machine.

Used by ``paged.backends.cpu_paged_decode`` (paged-decode attention, KV write),
``paged.models.cpu_layer_ops`` (fused norm, rotary, SiLU-and-mul) and
``paged.plugins.quant_kernels`` (int4 GEMM). ``build_and_load`` imports a source's library
from the torch extensions directory (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``), compiling it there first with
``torch.utils.cpp_extension.load_inline`` when it is not built yet. A source
exposes its kernels as a Python module (``PYBIND11_MODULE``: what eager code calls, ~0.15 us a
call) and, where ``torch.compile`` must see them, also as torch ops (``TORCH_LIBRARY``,
``torch.ops.<namespace>.<name>``; a call through the dispatcher costs ~1.7 us, and a decode step
makes ~300 of them). This needs a C++ compiler and ninja (a dependency of the package).

One build per machine, torch and Python: the build's name carries a hash of what decides the
library's code and ABI -- the source (with ``native_vec.h``), the flags, the torch version, the
Python ABI tag and the CPU's feature flags (``-march=native``) -- and of nothing else (not the
caller, the working directory, a venv's path or a test's environment), so every process that
asks for a library with the same key finds the same folder. A library already built there is
loaded directly (``importlib``), without going through ``load_inline``: that would run ninja
again, which rebuilds whenever its command line differs, and the command line holds the include
paths of the torch install that asked (two venvs with the same torch would rebuild each other's
build in turn). Only the headers a source needs are included (``torch/python.h`` for the
bindings, not ``torch/extension.h``, which alone takes ~30 s to parse): a first build takes
10-60 s, done by ``.ci/setup`` (``python -m paged.core.native MODULE ...``, each module's
``load()``) or on first use. ``native_vec.h`` (16-lane fp32 vectors and their loads) is put
before every source.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from paged.core.loading.startup_times import phase

CFLAGS = ["-O3", "-march=native", "-fopenmp", "-Wno-psabi"]  # psabi: GCC's notes on 64-byte vectors

_STALE_LOCK_S = 300  # a build takes well under a minute


def read_source(path: Path) -> str:
    """A kernel source as UTF-8 whatever the locale, so that its hash is the same in every process."""
    return path.read_text(encoding="utf-8")


VEC_HEADER = read_source(Path(__file__).parent / "native_vec.h")  # put before every source


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.strip() for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def build_key(source: str, cflags: list[str]) -> list[str]:
    """Everything a build depends on: the source and its header, the flags, torch (version and
    commit), the Python ABI and the CPU's feature flags. Nothing from the caller's environment."""
    return [VEC_HEADER, source, " ".join(cflags), torch.__version__, str(torch.version.git_version),
            sys.implementation.cache_tag, _cpu_flags()]


def build_name(prefix: str, source: str, cflags: list[str]) -> str:
    """``prefix`` + a hash of ``build_key``."""
    return prefix + hashlib.sha256("\0".join(build_key(source, cflags)).encode()).hexdigest()[:12]


def build_root() -> str:
    """Where the builds live: ``$TORCH_EXTENSIONS_DIR``, else torch's default (``~/.cache/torch_extensions``),
    computed as ``cpp_extension.get_default_build_root`` computes it: importing ``cpp_extension``
    (setuptools with it) costs every process that only loads a built library ~0.2 s of CPU."""
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return configured
    from torch import _appdirs

    return os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions"))


def library_path(name: str) -> str:
    """The built library of ``name`` (it may not exist yet)."""
    return os.path.join(build_root(), name, f"{name}.so")


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
    path = os.path.join(build_root(), name)
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


def _import_built(name: str, path: str) -> ModuleType:
    """Import a library built earlier, as ``load_inline`` would after building it."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_and_load(name: str, source: str, cflags: list[str], what: str, logger: logging.Logger) -> ModuleType:
    """Load the library ``name`` (see ``build_name``) if it is built, else compile ``source`` as
    ``name`` first; return it as a Python module. ``what`` names the kernels in the log: a build
    is announced before it starts (a first start pauses) and timed after. Raises whatever the
    build or the load raises."""
    with phase("kernels"):
        return _build_and_load(name, source, cflags, what, logger)


def _build_and_load(name: str, source: str, cflags: list[str], what: str, logger: logging.Logger) -> ModuleType:
    directory = build_directory(name)  # waits while another process builds it
    library = os.path.join(directory, f"{name}.so")
    start = time.perf_counter()
    if os.path.exists(library):
        try:
            module = _import_built(name, library)
            logger.debug("%s loaded from %s in %.2f s", what, library, time.perf_counter() - start)
            return module
        except ImportError as e:  # a build cut short, or a file from elsewhere: build it again
            logger.warning("the built %s in %s cannot be loaded (%s); building it again", what, directory, e)
            os.remove(library)
    from torch.utils import cpp_extension

    ensure_ninja()
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
    logger.info("compiled the %s in %.1f s", what, time.perf_counter() - start)
    return module


def main(argv: list[str] | None = None) -> int:
    """``python -m paged.core.native MODULE ...``: build (or find built) each kernel module's
    library by calling its ``load()``; what ``.ci/setup`` runs so that no later process compiles.
    A kernel module has ``build_name()`` and ``load()``. Exit 1 if a library is not built after."""
    import importlib

    modules = sys.argv[1:] if argv is None else argv
    if not modules:
        print("usage: python -m paged.core.native MODULE ...  (e.g. paged.models.cpu_layer_ops)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    missing = []
    for name in modules:
        module = importlib.import_module(name)
        module.load()  # None also where the library is built but this CPU cannot run it (int4/int8)
        path = library_path(module.build_name())
        print(f"{name}: {path if os.path.exists(path) else 'NOT BUILT'}", file=sys.stderr)
        if not os.path.exists(path):
            missing.append(name)
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
