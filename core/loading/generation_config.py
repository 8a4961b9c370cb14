"""Default sampling settings from a model's ``generation_config.json`` (as vLLM applies them).

Only the fields the file sets explicitly count, mapped to SamplingParams names: ``temperature``,
``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and ``max_new_tokens`` (-> ``max_tokens``).
A request that leaves a field unset gets the model's value; one that sets it keeps its own.
``do_sample`` is not consulted: like vLLM, a file that names a temperature means it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("paged")

FILE = "generation_config.json"
_FIELDS = {  # generation_config.json key -> SamplingParams field
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(model_dir: str | Path) -> dict[str, Any]:
    """The SamplingParams fields the model's generation_config.json sets ({} without one).
    An unreadable file or a value SamplingParams would refuse is skipped with a warning, never
    fatal: it is advice from the checkpoint, not a setting."""
    from paged.core.errors import InvalidRequestError
    from paged.core.sampling_params import SamplingParams

    path = Path(model_dir) / FILE
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        logger.warning("%s: unreadable, no sampling defaults from it: %s", path, e)
        return {}
    out: dict[str, Any] = {}
    for key, field in _FIELDS.items():
        value = raw.get(key) if isinstance(raw, dict) else None
        if value is None:
            continue
        try:
            SamplingParams(**{field: value})
        except (InvalidRequestError, TypeError) as e:
            logger.warning("%s: ignoring %s=%r: %s", path, key, value, e)
            continue
        out[field] = value
    return out


def describe(defaults: dict[str, Any]) -> str:
    """One line for the start-up log."""
    if not defaults:
        return "sampling defaults: SamplingParams' own (the model has no generation_config.json sampling fields)"
    fields = ", ".join(f"{k}={v}" for k, v in sorted(defaults.items()))
    return f"sampling defaults from the model's generation_config.json (for fields a request leaves unset): {fields}"


def load_generation_defaults(model_dir: str | Path) -> dict[str, Any]:
    """``generation_defaults``, logged at start-up so the effective defaults are visible."""
    defaults = generation_defaults(model_dir)
    logger.info("%s", describe(defaults))
    return defaults
