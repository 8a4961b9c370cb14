"""The pooler contract: how the pooling runner turns a prompt into one vector.

With ``model.runner: pooling`` the engine serves pooling requests only (embeddings, scores): a
request is its prompt, computed as any prompt is (chunked prefill under the token budget,
preemption by recompute, the prefix cache), and never samples a token. When its last prompt
token is computed, the pooler gets the final hidden states (after the model's last norm) the
request needs and returns its vector; the request then finishes with that vector as its whole
output. The engine calls the pooler once per step with every request that finished its prompt
in that step:

``pool(hidden_states) -> list[torch.Tensor]``: ``hidden_states`` holds one float32 tensor
``[n_i, hidden_size]`` per request, in prompt order; ``n_i`` is 1 (the last prompt token) unless
the pooler sets ``needs_all_tokens``, in which case it is every prompt token. It returns one 1-d
float32 vector per request (any length, the same for all requests of a model). Normalisation
(``pooling.normalize``, a request's ``normalize``) and a request's ``dimensions`` (Matryoshka
truncation) are applied afterwards by the front-end, not by the pooler.

``needs_all_tokens`` costs the prefix cache: such a request computes every prompt position, so
it never takes a cache hit (its blocks are still cached for others), and its rows are kept
until its prompt is done (``n_i x hidden_size`` float32; dropped when it is preempted).

A pooler that raises stops the engine, naming the plugin (as any plugin's fault does:
``paged.core.engine.plugin_faults``). Registered through ``register_poolers``
(``paged.core.hookspecs``) as a ``PoolerSpec``; ``factory(options, context) -> Pooler``, with
``options`` the spec's validated pydantic model (``pooling.options``) and ``context`` a
``PoolerContext``. The bundled ``last``, ``mean``, ``cls`` and ``max`` (``paged.plugins.poolers``)
are the reference implementations.

Which pooler runs: ``pooling.pooler`` names one; ``auto`` reads the checkpoint's
sentence-transformers configuration (``modules.json`` and its Pooling module's
``config.json``) and picks the mode it names, else ``last`` (a causal LM's usual embedding, as
vLLM's ``as_embedding_model`` adapter pools).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from paged.core.errors import ConfigError


@dataclass(frozen=True)
class PoolerContext:
    hidden_size: int
    model_dir: str
    hf_config: Any


@runtime_checkable
class Pooler(Protocol):
    needs_all_tokens: bool

    def pool(self, hidden_states: list[torch.Tensor]) -> list[torch.Tensor]:
        """One vector per request from its rows of final hidden states (float32)."""


# sentence-transformers' Pooling modes -> the bundled pooler that computes each
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
             "pooling_mode_max_tokens": "max"}
_ST_UNSUPPORTED = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class CheckpointPooling:
    """What a checkpoint's sentence-transformers configuration says: the pooler and whether a
    Normalize module follows (None: the checkpoint has no such configuration)."""

    pooler: str | None
    normalize: bool | None


def checkpoint_pooling(model_dir: str | Path) -> CheckpointPooling:
    """Read ``modules.json`` (and the Pooling module's ``config.json``); raises ConfigError for
    a module that would change the embedding and that paged does not run (a Dense layer, a
    pooling mode with no bundled pooler)."""
    path = Path(model_dir) / "modules.json"
    if not path.is_file():
        return CheckpointPooling(None, None)
    try:
        modules = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"pooling.pooler: auto could not read {path}: {e}; set pooling.pooler") from None
    pooler, normalize = None, False
    for module in modules if isinstance(modules, list) else []:
        kind = str(module.get("type", "")).rpartition(".")[2]
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            config_path = Path(model_dir) / str(module.get("path", "")) / "config.json"
            try:
                config = json.loads(config_path.read_text())
            except (OSError, ValueError) as e:
                raise ConfigError(f"pooling.pooler: auto could not read {config_path}: {e}; set pooling.pooler") from None
            modes = [m for m in (*_ST_MODES, *_ST_UNSUPPORTED) if config.get(m)]
            if len(modes) != 1 or modes[0] not in _ST_MODES:
                raise ConfigError(f"pooling.pooler: {config_path} asks for {modes or 'no mode'}; paged pools with one of "
                                  f"{', '.join(sorted(set(_ST_MODES.values())))} (set pooling.pooler to choose)")
            pooler = _ST_MODES[modes[0]]
        else:
            raise ConfigError(f"pooling.pooler: the checkpoint's sentence-transformers module {module.get('type')!r} "
                              f"({module.get('path')}) is not supported: its embeddings would differ; paged runs "
                              "Transformer, Pooling and Normalize modules")
    return CheckpointPooling(pooler, normalize)
