"""Helpers shared by the tests (on ``sys.path`` through pytest's ``pythonpath = ["tests"]``):
``server`` (a real ``paged serve`` subprocess), ``tiny_llama`` (a tiny random-weight model),
``batch`` (attention batches), ``default_model`` (the embedded model; a pytest plugin),
``fixture_packages`` (pip-installing the plugin packages of ``tests/fixtures``) and
``adversarial_policy``."""

from __future__ import annotations

from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = TESTS_DIR.parent
FIXTURES = TESTS_DIR / "fixtures"


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``paged ARGV`` in this process: (exit code, stdout, stderr); argparse's exits included."""
    from paged.core.cli.main import main

    try:
        rc = main(argv)
    except SystemExit as e:  # argparse: --help (0) and usage errors (2)
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err
