"""Small helpers shared by the engine, the front-end and the attention backends; no torch here
(``paged.core.tensors`` holds the tensor helpers), so that importing the front-end does not load it."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``, in integers."""
    return -(-a // b)


def __getattr__(name: str):
    # The tensor helpers used to live here: old imports keep working, loading torch only then.
    if name in ("ScratchBuffers", "zeros_untouched"):
        from paged.core import tensors

        return getattr(tensors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
