"""Bundled poolers (contract: ``paged.core.pooling``): ``last`` (the last prompt token's hidden
state: causal LMs' embedding, Qwen3-Embedding's), ``mean`` (the average over the prompt),
``cls`` (the first token's) and ``max`` (the element-wise maximum over the prompt)."""

from __future__ import annotations

import torch

from paged.core.hookspecs import PoolerSpec, hookimpl


class LastTokenPooler:
    needs_all_tokens = False

    def __init__(self, options=None, context=None) -> None:
        pass

    def pool(self, hidden_states: list[torch.Tensor]) -> list[torch.Tensor]:
        return [h[-1] for h in hidden_states]


class MeanPooler(LastTokenPooler):
    needs_all_tokens = True

    def pool(self, hidden_states: list[torch.Tensor]) -> list[torch.Tensor]:
        return [h.mean(dim=0) for h in hidden_states]


class FirstTokenPooler(LastTokenPooler):
    needs_all_tokens = True

    def pool(self, hidden_states: list[torch.Tensor]) -> list[torch.Tensor]:
        return [h[0] for h in hidden_states]


class MaxPooler(LastTokenPooler):
    needs_all_tokens = True

    def pool(self, hidden_states: list[torch.Tensor]) -> list[torch.Tensor]:
        return [h.amax(dim=0) for h in hidden_states]


@hookimpl
def register_poolers():
    return [
        PoolerSpec("last", LastTokenPooler, description="the last prompt token's final hidden state"),
        PoolerSpec("mean", MeanPooler, description="the mean of every prompt token's final hidden state"),
        PoolerSpec("cls", FirstTokenPooler, description="the first prompt token's final hidden state"),
        PoolerSpec("max", MaxPooler, description="the element-wise maximum over the prompt's final hidden states"),
    ]
