"""The model's settings, resolved once before any weight loads.

``resolve_model(config, registry, device)`` reads the directory's config.json (and
generation_config.json), picks the architecture's ``ModelSpec``, asks the implementation to
check the config and for its attention shape, and settles dtype, ``max_model_len``, EOS ids and
the tokenizer directory. A ``XForSequenceClassification`` checkpoint no plugin registers runs as
the registered ``XForCausalLM`` with its own ``score`` head instead of the LM head
(``classification_head``; the pooling runner only, ``paged.core.engine.pooling``). Everything downstream (the model runner, the engine core's
``ModelInfo`` for the front-ends) receives this one object, so a config mistake is reported
here, as ``ConfigError``/``ModelLoadError``, before seconds of weight loading.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from paged.core.config import EngineConfig
from paged.core.errors import ConfigError, ModelLoadError
from paged.core.hookspecs import ModelSpec
from paged.core.loading import config_snapshot
from paged.core.loading.loader import get_dtype, load_hf_config, model_architecture, resolve_model_dir
from paged.core.model import AttentionShape, model_attention_shape

DEFAULT_MAX_MODEL_LEN = 4096  # when neither the setting nor the model's config gives one


@dataclass(frozen=True)
class ResolvedModel:
    """Everything about the model the engine decides before building it."""

    model_dir: Path
    tokenizer_dir: Path
    hf_config: Any
    architecture: str
    spec: ModelSpec
    dtype: torch.dtype
    max_model_len: int
    eos_token_ids: list[int]
    attention_shape: AttentionShape
    vocab_size: int
    # a *ForSequenceClassification checkpoint: the causal LM's layers plus the checkpoint's score head
    classification_head: bool = False


def eos_token_ids(model_dir: str | Path, hf_config: Any = None) -> list[int]:
    """EOS ids: generation_config.json first (it may list several), else config.json's."""
    value = None
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        try:
            value = json.loads(path.read_text()).get("eos_token_id")
        except (ValueError, AttributeError) as e:
            raise ModelLoadError(f"model: cannot read {str(path)!r}: {type(e).__name__}: {e}") from e
    if value is None and hf_config is not None:
        value = getattr(hf_config, "eos_token_id", None)
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value]
    return []


def _max_model_len(setting: int | None, hf_config: Any) -> int:
    model_limit = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
    if setting is None:
        return model_limit or DEFAULT_MAX_MODEL_LEN
    if model_limit and setting > model_limit:
        raise ConfigError(
            f"model.max_model_len: {setting} exceeds the model's max_position_embeddings "
            f"({model_limit}); use at most {model_limit}"
        )
    return setting


def _bundled(spec: ModelSpec) -> bool:
    """Whether the architecture is one of paged's own (``paged.models``), whose code reads the
    config only through attributes a snapshot holds."""
    return getattr(spec.factory, "__module__", "").startswith("paged.models.")


def resolve_model(config: EngineConfig, registry: Any, device: torch.device | str) -> ResolvedModel:
    """Resolve ``config.model`` against the local files and the registered architectures."""
    model_dir = resolve_model_dir(config.model.model, config.model.revision)
    hf_config = load_hf_config(model_dir)
    architecture = model_architecture(hf_config)
    spec, classification_head = _model_spec(registry, architecture)
    if classification_head:
        if config.model.runner != "pooling":
            raise ConfigError(
                f"model.runner: {config.model.runner!r}, but {str(model_dir)!r} is a sequence classifier "
                f"(architectures [{architecture!r}]: a score head, no LM head); serve it with --runner pooling "
                "(/classify, /score, /rerank)"
            )
        hf_config = _tied_embeddings(hf_config)
    if not _bundled(spec):  # a plugin's model sees the transformers config itself, as it always has
        hf_config = config_snapshot.real(hf_config)
    check = getattr(spec.factory, "check_config", None)
    if check is not None:
        check(hf_config)
    shape = model_attention_shape(spec.factory, architecture, hf_config)
    dtype = get_dtype(config.model.dtype, hf_config, device)
    tokenizer_dir = Path(config.model.tokenizer).expanduser() if config.model.tokenizer else model_dir
    vocab_size = getattr(hf_config, "vocab_size", None)
    if not vocab_size:
        raise ModelLoadError(f"model: config.json of {str(model_dir)!r} has no vocab_size")
    return ResolvedModel(
        model_dir=model_dir,
        tokenizer_dir=tokenizer_dir,
        hf_config=hf_config,
        architecture=architecture,
        spec=spec,
        dtype=dtype,
        max_model_len=_max_model_len(config.model.max_model_len, hf_config),
        eos_token_ids=eos_token_ids(model_dir, hf_config),
        attention_shape=shape,
        vocab_size=int(vocab_size),
        classification_head=classification_head,
    )


CLASSIFICATION_SUFFIX = "ForSequenceClassification"


def _model_spec(registry: Any, architecture: str) -> tuple[ModelSpec, bool]:
    """The architecture's ModelSpec; for a ``XForSequenceClassification`` that no plugin
    registers, ``XForCausalLM``'s, and True (its layers and weight names are the causal LM's)."""
    if architecture.endswith(CLASSIFICATION_SUFFIX) and architecture not in registry.models:
        causal = architecture[: -len(CLASSIFICATION_SUFFIX)] + "ForCausalLM"
        if causal in registry.models:
            return registry.model(causal), True
    return registry.model(architecture), False


def _tied_embeddings(hf_config: Any) -> Any:
    """A copy of the config whose LM head shares the embedding matrix: a classifier's checkpoint
    has no ``lm_head.weight``, and its logits are never computed (the score head is used)."""
    tied = copy.deepcopy(config_snapshot.real(hf_config))
    tied.tie_word_embeddings = True
    return tied
