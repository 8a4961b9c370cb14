"""A model's tokenizer, loaded without torch: the API server's front-end tokenizes and
detokenizes but never runs the model, so it does not import torch (only its engine core does).
``paged.core.loading.loader`` re-exports ``load_tokenizer``, its old home."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from paged.core.errors import ModelLoadError
from paged.core.loading.startup_times import phase


def load_tokenizer(model_dir: str | Path, revision: str | None = None) -> Any:
    """``AutoTokenizer`` from a local directory, or a hub id's snapshot (through the hub cache)."""
    with phase("tokenizer"):
        return _load_tokenizer(model_dir, revision)


def _load_tokenizer(model_dir: str | Path, revision: str | None) -> Any:
    from paged.core.loading import config_snapshot, hub
    from paged.core.loading.gguf import cache_dir

    if hub.is_hub_id(str(model_dir)):
        model_dir = hub.hub_model_dir(str(model_dir), revision)
    try:
        return config_snapshot.load_tokenizer(Path(model_dir), cache_dir())
    except Exception as e:
        raise ModelLoadError(
            f"tokenizer: cannot load a tokenizer from {str(model_dir)!r}: {type(e).__name__}: {e}"
        ) from e
