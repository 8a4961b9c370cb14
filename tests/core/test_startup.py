"""Start-up stays cheap: ``import paged`` and the CLI's parser import no torch (nor transformers,
fastapi or numpy), and ``PAGED_STARTUP_TIMES=1`` times phases without counting nested ones twice.
The timings themselves are ``benchmarks/startup.py``'s."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from paged.core.loading import startup_times

HEAVY = ("torch", "transformers", "fastapi", "numpy")


def _modules_after(code: str) -> dict[str, bool]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps({{m: m in sys.modules for m in {HEAVY!r}}}))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_paged_imports_no_torch():
    loaded = _modules_after("import paged\nparams = paged.SamplingParams(max_tokens=4)")
    assert not any(loaded.values()), f"`import paged` imported {[m for m, v in loaded.items() if v]}"


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["serve", "--help"], ["lab", "replay", "--help"]])
def test_cli_help_imports_no_torch(argv):
    code = f"from paged.core.cli.main import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass"
    loaded = _modules_after(code)
    assert not any(loaded.values()), f"paged {' '.join(argv)} imported {[m for m, v in loaded.items() if v]}"


def test_the_front_end_imports_no_engine_and_no_torch():
    """The server's and AsyncLLM's modules talk to a core over ZeroMQ: they import the wire
    messages (and the scheduler's fit rule), not the engine core, sampler or runner, and so not torch."""
    probe = ("import json, sys\nimport paged.core.server.app, paged.core.frontend.async_llm\n"
             "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or m in ("
             "'paged.core.engine.engine_core', 'paged.core.engine.sampler', "
             "'paged.core.engine.model_runner', 'paged.core.engine.pooling'))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_tensor_helpers_old_import_path_still_works():
    from paged.core import tensors
    from paged.core.utils import ScratchBuffers, zeros_untouched

    assert ScratchBuffers is tensors.ScratchBuffers and zeros_untouched is tensors.zeros_untouched


def test_phases_exclude_what_is_timed_inside_them(monkeypatch, caplog):
    monkeypatch.setattr(startup_times, "enabled", True)
    clock = iter([0.0, 1.0, 3.0, 10.0])  # outer starts, inner starts, inner ends, outer ends
    cpu = iter([0.0, 0.5, 1.0, 4.0])
    monkeypatch.setattr(startup_times.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(startup_times.time, "process_time", lambda: next(cpu))
    with caplog.at_level(logging.DEBUG, logger="paged.startup"), startup_times.phase("outer"):
        with startup_times.phase("inner"):
            pass
    assert [r.getMessage() for r in caplog.records] == ["inner 2.0000 0.5000", "outer 8.0000 3.5000"]


def test_phases_cost_nothing_when_off(monkeypatch, caplog):
    monkeypatch.setattr(startup_times, "enabled", False)
    with caplog.at_level(logging.DEBUG, logger="paged.startup"):
        with startup_times.phase("load"):
            pass
        startup_times.record("first token", 1.0)
    assert caplog.records == []


def test_process_age_is_this_process():
    age = startup_times.process_age()
    assert age is None or 0 <= age < 24 * 3600


def test_the_benchmark_sums_the_logged_phases():
    import importlib.util

    from helpers import REPO_ROOT

    spec = importlib.util.spec_from_file_location("startup_bench", REPO_ROOT / "benchmarks" / "startup.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    stderr = ("INFO paged: loaded\nDEBUG paged.startup: quantize 0.2500 0.5000\n"
              "DEBUG paged.startup: quantize 0.5000 1.0000\nDEBUG paged.startup: first token 0.1000 0.0000\n")
    assert bench.phases_of(stderr) == {"quantize": (0.75, 1.5), "first token": (0.1, 0.0)}
