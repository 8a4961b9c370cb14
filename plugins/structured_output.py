"""Bundled structured-output backends: ``xgrammar`` (the default) and ``llguidance``.

Loading this plugin imports neither engine: availability looks for the package, and the
factories import the backend modules when the core builds one.
"""

from __future__ import annotations

import importlib.util

from paged.core.hookspecs import StructuredOutputBackendSpec, hookimpl
from paged.backends import llguidance_backend as _llg
from paged.backends import xgrammar_backend as _xgr


def _installed(package: str):
    def check() -> tuple[bool, str]:
        if importlib.util.find_spec(package) is None:
            return False, f"the {package!r} package is not installed (pip install {package})"
        return True, ""

    return check


@hookimpl
def register_structured_output_backends():
    return [
        StructuredOutputBackendSpec(
            name="xgrammar",
            factory=_xgr.XGrammarBackend,
            validate=_xgr.validate,
            options=_xgr.XGrammarOptions,
            description="xgrammar: grammars compiled with precomputed token masks (JSON schema, regex, choice, EBNF)",
            is_available=_installed("xgrammar"),
        ),
        StructuredOutputBackendSpec(
            name="llguidance",
            factory=_llg.LLGuidanceBackend,
            validate=_llg.validate,
            options=_llg.LLGuidanceOptions,
            description="llguidance: Earley parser, masks computed per step, no compile step (JSON schema, regex, "
            "choice, Lark/GBNF)",
            is_available=_installed("llguidance"),
        ),
    ]
