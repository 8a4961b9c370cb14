"""Hugging Face hub model ids (``--model org/name``) through ``huggingface_hub``.

A model setting that is not a local path and has the form ``org/name`` is a hub id: it resolves
to a snapshot directory of the hub cache (``HF_HUB_CACHE`` / ``HF_HOME``), downloading only the
files paged can use (safetensors weights, JSON configs, tokenizer files; never pickles) unless
``HF_HUB_OFFLINE=1``, when only the cache is read. ``model.revision`` picks a branch, tag or
commit (default: main).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from paged.core.errors import ModelLoadError

logger = logging.getLogger("paged")

# What a model directory needs; everything else in a repo (pickled *.bin, GGUF, ONNX, ...) is skipped.
ALLOW_PATTERNS = ["*.safetensors", "*.json", "tokenizer*", "*.model", "*.tiktoken", "merges.txt", "vocab.txt"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def is_hub_id(model: str) -> bool:
    """``org/name`` that is not an existing local path."""
    return bool(_HUB_ID.match(model)) and not Path(model).expanduser().exists()


def hub_model_dir(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot directory of ``repo_id`` at ``revision`` (downloaded when missing,
    unless the hub is offline)."""
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub import errors as hub_errors
    except ImportError:
        raise ModelLoadError(
            f"model: {repo_id!r} looks like a Hugging Face hub id, which needs `pip install huggingface_hub`; "
            "or give a local model directory or .gguf file"
        ) from None
    offline = bool(constants.HF_HUB_OFFLINE)
    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        path = snapshot_download(
            repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS, local_files_only=offline
        )
    except hub_errors.LocalEntryNotFoundError:
        cache = constants.HF_HUB_CACHE
        hint = "HF_HUB_OFFLINE=1 is set, so nothing is downloaded" if offline else "and the hub cannot be reached"
        raise ModelLoadError(
            f"model: {where} is not in the Hugging Face cache ({cache}) {hint}. Download it first "
            f"(`huggingface-cli download {repo_id}`), unset HF_HUB_OFFLINE, or give a local directory."
        ) from None
    except hub_errors.RevisionNotFoundError:
        raise ModelLoadError(f"model.revision: {revision!r} is not a branch, tag or commit of {repo_id!r}") from None
    except (hub_errors.RepositoryNotFoundError, hub_errors.GatedRepoError) as e:
        raise ModelLoadError(
            f"model: cannot access the hub repository {repo_id!r} ({type(e).__name__}); check the name, "
            "or log in (`huggingface-cli login`) for a gated or private model"
        ) from None
    except (hub_errors.HfHubHTTPError, OSError) as e:
        raise ModelLoadError(f"model: downloading {where} failed: {type(e).__name__}: {e}") from None
    logger.info("model %s: hub snapshot %s", where, path)
    return Path(path)
