"""The pooling runner's engine side (contract: ``paged.core.pooling``): which pooler runs and with
what settings, resolved before any weight loads, and the rows of hidden states a pooler that
reads every prompt token is given, kept per request across its prefill chunks.

A classifier (``pooling.classifier_from_tokens``) pools with the LM head instead: the logits of
the listed tokens at the last prompt position (those rows go through the LM head on every
tensor-parallel rank, as sampled rows do); the front-end turns them into a score (the last
token's softmax probability over the listed ones)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from paged.core.errors import ConfigError, ModelLoadError
from paged.core.pooling import PoolerContext, checkpoint_pooling

HEAD_WEIGHTS = ("score.weight", "score.bias")  # a *ForSequenceClassification checkpoint's head


def is_head_weight(name: str) -> bool:
    return name in HEAD_WEIGHTS


# a sentence-transformers CrossEncoder's activation (config.json) -> the front-end's name for it
_CROSS_ENCODER_ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "none", "Softmax": "softmax", "Tanh": "tanh"}


@dataclass
class PoolingSetup:
    """What the pooling runner runs (``build`` makes the pooler and finds the classifier's ids)."""

    name: str  # the pooler's name, "classifier" (tokens' logits) or "classify" (the checkpoint's head)
    spec: Any  # PoolerSpec; None for a classifier
    options: Any
    normalize: bool
    max_dimensions: int | None
    classifier_tokens: list[str] | None
    score_template: str = "{query}\n{document}"
    classification_head: bool = False
    pooler: Any = None
    classifier_token_ids: list[int] | None = None
    head_weight: torch.Tensor | None = None  # [num_labels, hidden] float32
    head_bias: torch.Tensor | None = None
    labels: list[str] | None = None  # a classifier's: the head's id2label, or the listed tokens
    activation: str | None = None  # logits -> probabilities: sigmoid, softmax, tanh or none

    @property
    def needs_all_tokens(self) -> bool:
        return self.pooler is not None and bool(self.pooler.needs_all_tokens)

    def info(self) -> dict[str, Any]:
        """For the front-ends (``ModelInfo.pooling``); ``labels`` marks a classifier."""
        return {"pooler": self.name, "normalize": self.normalize, "max_dimensions": self.max_dimensions,
                "classifier_tokens": self.classifier_tokens, "score_template": self.score_template,
                "labels": self.labels, "activation": self.activation}

    def build(self, model_config, device: torch.device | str = "cpu") -> None:
        """Make the pooler (``spec.factory(options, context)``), read the checkpoint's head, or
        look up the classifier's token ids in the tokenizer: each listed word must be one token."""
        hf = model_config.hf_config
        hidden = int(getattr(hf, "hidden_size", 0) or getattr(getattr(hf, "text_config", None), "hidden_size", 0))
        if self.classification_head:
            self._read_head(model_config.model_dir, hf, hidden, device)
            return
        if self.classifier_tokens is None:
            self.pooler = self.spec.factory(self.options, PoolerContext(hidden, str(model_config.model_dir), hf))
            return
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_config.tokenizer_dir or model_config.model_dir))
        ids = []
        for word in self.classifier_tokens:
            token_ids = tokenizer(word, add_special_tokens=False)["input_ids"]
            if len(token_ids) != 1:
                raise ConfigError(f"pooling.classifier_from_tokens: {word!r} is {len(token_ids)} tokens ({token_ids}) "
                                  "in this model's tokenizer; each entry must be exactly one token")
            ids.extend(token_ids)
        self.classifier_token_ids = ids
        self.labels = list(self.classifier_tokens)
        self.activation = "sigmoid" if len(ids) == 1 else "softmax"

    def _read_head(self, model_dir, hf_config: Any, hidden: int, device) -> None:
        from safetensors import safe_open

        from paged.core.loading.loader import safetensors_files

        found: dict[str, torch.Tensor] = {}
        for path in safetensors_files(model_dir):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in HEAD_WEIGHTS:
                    if name in f.keys():
                        found[name] = f.get_tensor(name)
        weight = found.get("score.weight")
        if weight is None or weight.dim() != 2 or weight.shape[1] != hidden:
            raise ModelLoadError(f"model: {str(model_dir)!r} is a sequence classifier but its checkpoint has "
                                 f"{'no score.weight' if weight is None else f'score.weight of {tuple(weight.shape)}'}; "
                                 f"expected [num_labels, {hidden}]")
        num_labels = weight.shape[0]
        self.head_weight = weight.to(device, torch.float32)
        bias = found.get("score.bias")
        self.head_bias = None if bias is None else bias.to(device, torch.float32)
        names = getattr(hf_config, "id2label", None) or {}
        self.labels = [str(names.get(i, names.get(str(i), f"LABEL_{i}"))) for i in range(num_labels)]
        self.activation = _head_activation(hf_config, num_labels)


def _head_activation(hf_config: Any, num_labels: int) -> str:
    """As HF's pipelines and sentence-transformers' CrossEncoder read a head: the CrossEncoder's
    configured activation, else sigmoid for one label or multi-label problems, else softmax."""
    cross_encoder = getattr(hf_config, "sentence_transformers", None)
    named = (cross_encoder or {}).get("activation_fn") if isinstance(cross_encoder, dict) else None
    named = named or getattr(hf_config, "sbert_ce_default_activation_function", None)
    if isinstance(named, str) and named.rpartition(".")[2] in _CROSS_ENCODER_ACTIVATIONS:
        return _CROSS_ENCODER_ACTIVATIONS[named.rpartition(".")[2]]
    if num_labels == 1 or getattr(hf_config, "problem_type", None) == "multi_label_classification":
        return "sigmoid"
    return "softmax"


def resolve_pooling(config, registry, model_dir: str, hf_config: Any,
                    classification_head: bool = False) -> PoolingSetup | None:
    """``model.runner: pooling``'s settings, checked (plugin names and options too); None for the
    generate runner. ``classification_head``: the checkpoint's own head scores."""
    from paged.core.config import validate_options

    if config.model.runner != "pooling":
        return None
    settings = config.pooling
    if config.speculative.method is not None:
        raise ConfigError(f"speculative.method: {config.speculative.method!r} cannot run with model.runner=pooling "
                          "(a pooling request generates no tokens); unset it")
    found = checkpoint_pooling(model_dir)
    normalize = settings.normalize
    if normalize is None:
        normalize = True if found.normalize is None else found.normalize
    max_dimensions = settings.max_dimensions
    if max_dimensions is None:
        dims = getattr(hf_config, "matryoshka_dimensions", None)
        if dims:
            max_dimensions = max(int(d) for d in dims)
        elif getattr(hf_config, "is_matryoshka", False):
            max_dimensions = int(getattr(hf_config, "hidden_size", 0)) or None
    if classification_head:
        for field, value, default in (("pooler", settings.pooler, "auto"),
                                      ("classifier_from_tokens", settings.classifier_from_tokens, None)):
            if value != default:
                raise ConfigError(f"pooling.{field}: {value!r}, but this checkpoint is a sequence classifier (its "
                                  f"architectures: {getattr(hf_config, 'architectures', None)}): its own score head "
                                  f"scores; leave pooling.{field} unset")
        return PoolingSetup("classify", None, None, normalize, None, None, settings.score_template,
                            classification_head=True)
    if settings.classifier_from_tokens is not None:
        if settings.pooler not in ("auto", "last"):
            raise ConfigError(f"pooling.pooler: {settings.pooler!r} cannot be combined with pooling.classifier_from_tokens "
                              "(a classifier reads the last token's logits); leave pooling.pooler at auto")
        return PoolingSetup("classifier", None, None, normalize, None, list(settings.classifier_from_tokens),
                            settings.score_template)
    name = settings.pooler
    if name == "auto":
        name = found.pooler or "last"
    spec = registry.pooler(name)
    return PoolingSetup(name, spec, validate_options(spec, settings.options, "pooling.options"), normalize,
                        max_dimensions, None, settings.score_template)


class PoolingRows:
    """The final hidden states kept for requests whose pooler reads every prompt token: one
    float32 copy per prefill chunk, in order (a request that needs them never takes a
    prefix-cache hit, so its chunks start at position 0). Dropped when the request is
    preempted or finishes."""

    def __init__(self) -> None:
        self.rows: dict[str, list[torch.Tensor]] = {}

    def add(self, request_id: str, hidden: torch.Tensor) -> None:
        self.rows.setdefault(request_id, []).append(hidden.to(torch.float32, copy=True))

    def take(self, request_id: str) -> torch.Tensor:
        parts = self.rows.pop(request_id)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def drop(self, request_ids) -> None:
        for request_id in request_ids:
            self.rows.pop(request_id, None)
