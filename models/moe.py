"""The sparse mixture-of-experts MLP (``FusedMoE``): a router picks ``top_k`` of ``num_experts``
gated SiLU experts per token, and only those run.

One forward over ``[T, hidden]`` flattened tokens:

1. route: ``softmax(gate(x))`` in float32, its ``top_k`` largest (optionally renormalised to sum
   to 1, ``norm_topk_prob``);
2. group: the ``T * top_k`` (token, expert) assignments sorted by expert with one ``argsort``,
   so each expert's tokens are one contiguous run (no Python loop over tokens);
3. one GEMM pair per *active* expert on its run of tokens (``gate_up_proj``, the fused
   SiLU-and-mul CPU op the dense MLP uses, ``down_proj``), scaled by the routing weights;
4. combine: the weighted outputs gathered back per token (the inverse permutation) and each
   token's ``top_k`` terms summed in ascending expert order, as HF's ``index_add_`` loop adds
   them (so bfloat16 results round alike).

Experts are held one module each, with the ordinary ``paged.models.layers`` linear kinds, so
``quantize_weights`` quantizes every expert like any linear (int8, int4, or a GGUF checkpoint's
own blocks: each expert's checkpoint name has its own block scales), ``prepack_cpu_linears``
packs them and ``checkpoint_slices`` loads them from HF's per-expert tensors
(``...experts.{e}.gate_proj.weight``).

Tensor parallelism: every rank holds every expert, each with its slice of the intermediate
dimension (gate/up rows, down columns, as ``GatedMLP``); the experts' partial outputs are summed
locally and the ranks' sums added by one all-reduce per layer (not one per expert). The router
is replicated, so every rank picks the same experts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged.core.engine.distributed import get_tp, shard_range
from paged.core.errors import ModelLoadError
from paged.models import cpu_layer_ops
from paged.models.layers import MergedColumnParallelLinear, RowParallelLinear, _empty_param

__all__ = ["ExpertMLP", "FusedMoE", "Router", "check_moe_config"]


class Router(nn.Module):
    """``x W^T`` with ``W [out_features, hidden]`` replicated on every rank: the router's logits
    over the experts (or a shared expert's one-column gate).

    Not a ``Linear`` on purpose: ``quantize_weights`` and ``prepack_cpu_linears`` leave it dense.
    Routing is a discrete choice that quantization noise would flip (another expert, not a
    slightly different value), the weight is tiny (``num_experts x hidden``), and llama.cpp keeps
    it in float32 in GGUF files for the same reason."""

    def __init__(self, hidden_size: int, out_features: int, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.weight = _empty_param(out_features, hidden_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"hidden={self.weight.shape[1]}, out_features={self.weight.shape[0]}"


class ExpertMLP(nn.Module):
    """One gated SiLU expert, ``down(silu(gate(x)) * up(x))``, of which this rank holds the
    intermediate slice ``shard_range(intermediate_size)``.

    ``names`` are the checkpoint's ``(gate, up, down)`` names under this module (HF Qwen:
    ``gate_proj, up_proj, down_proj``; Mixtral: ``w1, w3, w2``): the fused projection is
    ``gate_up_proj`` (loaded from the first two), the down projection a submodule named like
    the checkpoint's. ``partial`` returns this rank's share of the output *without* the
    all-reduce: the caller sums every expert first and reduces once."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
        *,
        dtype: torch.dtype,
        device,
    ) -> None:
        super().__init__()
        tp = get_tp()
        start, end = shard_range(intermediate_size, tp.rank, tp.size)
        gate, up, down = names
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size,
            {gate: intermediate_size, up: intermediate_size},
            {gate: (start, end), up: (start, end)},
            False,
            dtype=dtype,
            device=device,
        )
        self.down_name = down
        self.add_module(down, RowParallelLinear(intermediate_size, hidden_size, False, (start, end), dtype=dtype, device=device))
        self.intermediate_size = end - start  # this rank's share

    @property
    def down(self) -> RowParallelLinear:
        return self._modules[self.down_name]  # type: ignore[return-value]

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's term of ``down(silu(gate(x)) * up(x))`` (the sum over ranks is the value)."""
        gate_up = self.gate_up_proj(x)
        ops = cpu_layer_ops.enabled(gate_up)
        if ops is not None and gate_up.dim() == 2:
            act = ops.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            act = F.silu(gate) * up
        return self.down._linear(act, None)  # no bias, no all-reduce: summed by the caller


class FusedMoE(nn.Module):
    """Router (``gate``) + ``num_experts`` experts (``experts.{e}``); ``forward(x [T, H]) -> [T, H]``.

    ``norm_topk_prob``: the chosen experts' probabilities renormalised to sum to 1 (Mixtral
    always; Qwen2-MoE / Qwen3-MoE as their config says). ``float32_routing_weights``: the expert
    outputs are multiplied by the float32 weights and rounded once (HF Mixtral); otherwise the
    weights are rounded to the activations' dtype first (HF Qwen2-MoE / Qwen3-MoE). The two agree
    in float32. The terms are added in the activations' dtype, in HF's order.

    Subclasses add terms to ``partial`` (a shared expert) and keep the single all-reduce."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        *,
        norm_topk_prob: bool,
        float32_routing_weights: bool = False,
        expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
        dtype: torch.dtype,
        device,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.tp = get_tp()
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.float32_routing_weights = float32_routing_weights
        self.gate = Router(hidden_size, num_experts, dtype=dtype, device=device)
        self.experts = nn.ModuleList(
            ExpertMLP(hidden_size, intermediate_size, expert_names, dtype=dtype, device=device)
            for _ in range(num_experts)
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, top_k], expert ids [T, top_k] int64)``: the chosen experts per token,
        largest probability first; weights float32 (float64 for float64 ``x``), or in ``x.dtype``
        unless ``float32_routing_weights``."""
        # float32 at least (as HF); float64 stays float64 (the brute-force reference test)
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.promote_types(x.dtype, torch.float32))
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.float32_routing_weights:
            weights = weights.to(x.dtype)
        return weights, ids

    def experts_partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of ``sum_k weight_k * expert_{id_k}(x)`` per token, before the all-reduce.

        The expert outputs land in one buffer in sorted (expert-major) order and are gathered
        back per token, each token's terms added in ascending expert order in ``x.dtype``: the
        order and roundings of HF's ``index_add_`` loop, without a scatter (CPU ``index_add_``
        of bfloat16 rows measured ~25 ms a call under load, more than the experts' GEMMs)."""
        weights, ids = self.route(x)
        ids, perm = ids.sort(dim=-1)  # each token's experts ascending: the order its terms are added in
        weights = weights.gather(-1, perm)
        if x.shape[0] == 1:  # a batch-1 decode step: its experts in order, no grouping to do
            out = None
            for j, e in enumerate(ids[0].tolist()):
                term = (self.experts[e].partial(x) * weights[:, j : j + 1]).to(x.dtype)
                out = term if out is None else out + term
            return out
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert, tokens in order within
        token_of = order // self.top_k  # the token of each sorted assignment
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host sync per layer
        outputs = []
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                outputs.append(expert.partial(x.index_select(0, token_of[start : start + count])))
                start += count
        # weighted in the sorted order and rounded to x.dtype once (Mixtral's float32 weights too)
        terms = (torch.cat(outputs) * weights.reshape(-1)[order].unsqueeze(-1)).to(x.dtype)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        terms = terms.index_select(0, inverse).view(x.shape[0], self.top_k, x.shape[-1])
        out = terms[:, 0]
        for j in range(1, self.top_k):
            out = out + terms[:, j]
        return out

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """Everything this block adds to the residual stream, this rank's share (overridden to add
        a shared expert)."""
        return self.experts_partial(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.partial(x))

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}"


def check_moe_config(architecture: str, hf_config: Any, num_experts_field: str) -> None:
    """ModelLoadError naming the field for a routing config this layer cannot run."""
    num_experts = getattr(hf_config, num_experts_field, None)
    top_k = getattr(hf_config, "num_experts_per_tok", None)
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ModelLoadError(f"{architecture}: {num_experts_field} must be a positive integer, got {num_experts!r}")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ModelLoadError(
            f"{architecture}: num_experts_per_tok must be an integer in [1, {num_experts_field}={num_experts}], "
            f"got {top_k!r}"
        )
