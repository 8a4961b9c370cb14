"""Layers shared by the decoder-only models: the one place where norms, linears, MLP and the
paged attention wrapper are defined (rotary embeddings: ``paged.models.rotary``, re-exported here).

On a CPU, in eager mode, RMSNorm, rotary and SiLU- (or GELU-tanh-) and-mul run as fused C++ ops
(``paged.models.cpu_layer_ops``: the same values, one call each instead of ten).

All modules take flattened tokens: ``[num_tokens, ...]`` with a 1-D ``positions`` tensor, never
``[batch, seq, ...]``. Parameters are created uninitialised on the target dtype and device
(``load_weights`` fills every one of them, or fails) and never require grad.

Tensor parallelism (``paged.core.engine.distributed``): the layers read the current group when they
are built and hold only their rank's share. Column-parallel layers (fused QKV, gate-up) keep a
slice of the output rows, row-parallel layers (o_proj, down_proj) the matching input columns and
sum their partial outputs with one all-reduce; the embedding and the LM head split the
vocabulary. Each parameterised module says which slice of which checkpoint tensor fills it
(``checkpoint_slices``), so loading a shard reads only its rows or columns.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from paged.core.attention import AttentionSettings, check_backend_supports
from paged.core.engine.distributed import HeadShard, get_tp, shard_heads, shard_range
from paged.core.errors import ModelLoadError
from paged.core.loading.weights import CheckpointSlice, whole_parameters  # re-exported: public here too
from paged.core.quantization import QuantizedWeight
from paged.core.utils import cdiv
from paged.models import cpu_layer_ops
from paged.models.rotary import (  # noqa: F401 (public here: model plugins import them from layers)
    SUPPORTED_ROPE_TYPES,
    RotaryEmbedding,
    compute_inv_freq,
    rope_settings,
    rope_type_of,
)

# ---- parameters without initialisation ------------------------------------------------------


def _empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def _with_dim(shape: torch.Size, dim: int, size: int) -> tuple[int, ...]:
    out = list(shape)
    out[dim] = size
    return tuple(out)


def linear(
    x: torch.Tensor, weight: torch.Tensor, packed_weight: torch.Tensor | None, bias: torch.Tensor | None,
    qweight: QuantizedWeight | None = None,
) -> torch.Tensor:
    """``x W^T (+ b)``, through the quantized weight when there is one (``quantize_weights``),
    else the oneDNN-packed copy of ``W`` when there is one (``prepack_cpu_linears``)."""
    if qweight is not None:
        return qweight.linear(x, bias)
    if packed_weight is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with an uninitialised weight ``[out_features, in_features]``
    (replicated on every rank)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = _empty_param(out_features, in_features, dtype=dtype, device=device)
        if bias:
            self.bias = _empty_param(out_features, dtype=dtype, device=device)
        else:
            self.register_parameter("bias", None)

    packed_weight: torch.Tensor | None = None  # set by prepack_cpu_linears
    qweight: QuantizedWeight | None = None  # set by quantize_weights
    # The layer's LoRA adapter slots (paged.core.engine.lora_manager.LayerLoRA), set when LoRA is
    # enabled: in a step where some rows have an adapter, _linear adds them to its output.
    lora: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None and self.lora is None:  # _linear, one call less (a decode step makes 120)
            return self.qweight.linear(x, self.bias)
        return self._linear(x, self.bias)

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = linear(x, self.weight, self.packed_weight, bias, self.qweight)
        lora = self.lora
        if lora is not None and lora.batch.token_slots is not None:
            lora.kernel.apply(y, x, lora.weights, lora.batch)  # in place, every row at once (paged.core.lora)
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class RowParallelLinear(Linear):
    """A linear layer whose input features ``[in_start, in_end)`` of ``full_in_features`` live on
    this rank: each rank computes a partial ``x_shard W_shard^T`` and one all-reduce sums them.
    The bias (replicated) is added by rank 0 only, so it is counted once."""

    def __init__(self, full_in_features: int, out_features: int, bias: bool, in_range: tuple[int, int], *, dtype, device) -> None:
        super().__init__(in_range[1] - in_range[0], out_features, bias, dtype=dtype, device=device)
        self.tp = get_tp()
        self.full_in_features = full_in_features
        self.in_start = in_range[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            if self.qweight is not None and self.lora is None:
                return self.qweight.linear(x, self.bias)
            return self._linear(x, self.bias)
        # each rank adds its input columns' share of the adapters: the all-reduce sums them too
        return self.tp.all_reduce(self._linear(x, self.bias if self.tp.is_first else None))

    def checkpoint_slices(self, name: str) -> dict[str, CheckpointSlice]:
        out = {f"{name}.weight": CheckpointSlice(
            self.weight, 1, 0, self.in_start, self.in_features, (self.out_features, self.full_in_features)
        )}
        if self.bias is not None:
            out[f"{name}.bias"] = CheckpointSlice.whole(self.bias)
        return out


class MergedColumnParallelLinear(Linear):
    """Several checkpoint projections of the same input stacked by rows (gate and up): this rank
    holds rows ``[start, end)`` of each, stacked in the same order."""

    def __init__(self, in_features: int, full_sizes: dict[str, int], ranges: dict[str, tuple[int, int]], bias: bool, *, dtype, device) -> None:
        super().__init__(in_features, sum(e - s for s, e in ranges.values()), bias, dtype=dtype, device=device)
        self.full_sizes = full_sizes
        self.ranges = ranges

    def checkpoint_slices(self, name: str) -> dict[str, CheckpointSlice]:
        parent = name.rpartition(".")[0]
        out: dict[str, CheckpointSlice] = {}
        for kind, param in self.named_parameters(recurse=False):
            dest = 0
            for shard, (start, end) in self.ranges.items():
                full = _with_dim(param.shape, 0, self.full_sizes[shard])
                out[f"{parent}.{shard}.{kind}"] = CheckpointSlice(param, 0, dest, start, end - start, full)
                dest += end - start
        return out


class VocabParallelEmbedding(nn.Module):
    """Token embeddings split by vocabulary: rank ``r`` holds rows ``[r*S, min((r+1)*S, V))``
    with ``S = ceil(V / size)`` (zero padding rows make the shards equal). A token outside this
    rank's rows contributes zeros; one all-reduce assembles the embedding."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.tp = get_tp()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.shard_size = cdiv(num_embeddings, self.tp.size)
        self.vocab_start = self.tp.rank * self.shard_size
        self.vocab_end = min(self.vocab_start + self.shard_size, num_embeddings)
        self.weight = _empty_param(self.shard_size, embedding_dim, dtype=dtype, device=device)
        if self.vocab_end - self.vocab_start < self.shard_size:
            with torch.no_grad():
                self.weight[self.vocab_end - self.vocab_start :].zero_()

    qweight: QuantizedWeight | None = None  # set by quantize_weights

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight) if self.qweight is None else self.qweight.embedding(ids)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(input_ids)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = self._lookup((input_ids - self.vocab_start).masked_fill_(outside, 0))
        return self.tp.all_reduce(local.masked_fill_(outside.unsqueeze(-1), 0))

    def checkpoint_slices(self, name: str) -> dict[str, CheckpointSlice]:
        return {f"{name}.weight": CheckpointSlice(
            self.weight, 0, 0, self.vocab_start, self.vocab_end - self.vocab_start,
            (self.num_embeddings, self.embedding_dim),
        )}

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end})"


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection split by vocabulary like the embedding (so a tied head shares its
    weight shard): each rank computes its logit columns and rank 0 gathers them."""

    packed_weight: torch.Tensor | None = None  # set by prepack_cpu_linears

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits ``[N, vocab]`` on rank 0; None on the other ranks. A quantized weight
        with ``linear_float`` (optional, e.g. the ``gguf`` method's) gives them in float32 as it
        sums them, not rounded to the model's dtype first."""
        linear_float = getattr(self.qweight, "linear_float", None)
        local = (linear_float(hidden_states) if linear_float is not None
                 else linear(hidden_states, self.weight, self.packed_weight, None, self.qweight))
        logits = self.tp.gather_last_dim(local)
        return None if logits is None else logits[:, : self.num_embeddings].float()


def prepack_cpu_linears(model: nn.Module) -> int:
    """Give every linear layer (and the LM head) a oneDNN-packed copy of its weight, used by its
    forward from then on. For bfloat16 on CPUs: there the packed GEMM is faster than
    ``F.linear`` at 1-64 rows (decode batches), with the same results: 1.07-1.18x for a step's
    layer weights read from memory and 1.4-1.7x for the LM head (``benchmarks/dense_gemm.py``,
    this 2-core AMX machine). Not for float32: there it is 1.1-2.7x faster at 4-64 rows but
    9-22% slower at one row, the batch-1 decode, and keeping both layouts would double the
    weights. A layer's dense weight is released afterwards unless another module shares it (a
    tied LM head keeps the embedding's). Returns the number of layers packed (0 where oneDNN is
    unavailable)."""
    if not torch.backends.mkldnn.is_available():
        return 0
    users: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1
    packed = 0
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (Linear, ParallelLMHead)) and module.qweight is None:
                module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
                if users[id(module.weight)] == 1:
                    module.weight.data = torch.empty(0, dtype=module.weight.dtype)  # only the packed copy is used
                packed += 1
    return packed


def quantize_weights(model: nn.Module, quantizer: Callable[[torch.Tensor, dict[str, CheckpointSlice]], QuantizedWeight | None]) -> int:
    """Replace the weight of every linear layer, the LM head and the embedding by
    ``quantizer(weight, checkpoint_slices)`` where it returns one (``paged.core.loading.quantize``);
    a weight shared by two modules (tied embedding and head) is quantized once. The dense
    weight is released afterwards. Returns the number of modules quantized."""
    done: dict[int, QuantizedWeight] = {}
    count = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, (Linear, VocabParallelEmbedding)) or module.weight.device.type == "meta":
                continue
            key = id(module.weight)
            if key not in done:
                slices = module.checkpoint_slices(name) if hasattr(module, "checkpoint_slices") else whole_parameters(name, module)
                quantized = quantizer(module.weight.detach(), {n: s for n, s in slices.items() if s.param is module.weight})
                if quantized is None:
                    continue
                done[key] = quantized
            module.qweight = done[key]
            count += 1
        for module in model.modules():
            if isinstance(module, (Linear, VocabParallelEmbedding)) and id(module.weight) in done:
                module.weight.data = torch.empty(0, dtype=module.weight.dtype)  # only the quantized copy is used
    return count


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights as held: dense parameters, packed copies and quantized weights
    (each shared object counted once)."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        items = [*module.parameters(recurse=False), getattr(module, "packed_weight", None), getattr(module, "qweight", None)]
        for item in items:
            if item is None or id(item) in seen:
                continue
            seen.add(id(item))
            if isinstance(item, torch.Tensor):
                total += item.numel() * item.element_size() if item.device.type != "meta" else 0
            else:
                total += item.nbytes()
    return total


# ---- RMSNorm ---------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 and cast back before the weight (as HF does).

    With ``residual`` it first adds ``x + residual`` and returns ``(normed, new_residual)``:
    the decoder layers keep the residual stream separate and fold the add into the norm.
    """

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty_param(hidden_size, dtype=dtype, device=device)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ops = cpu_layer_ops.enabled(x)
        weight = self.weight
        if ops is not None and x.dtype == weight.dtype:  # one fused op instead of ten
            if residual is None:
                return ops.rms_norm(x, weight, self.eps)
            if residual.dtype == x.dtype and residual.shape == x.shape:  # else: the torch ops broadcast
                return ops.add_rms_norm(x, residual, weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


# ---- rotary embedding ------------------------------------------------------------------------

class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one column-parallel projection
    (``gate_up_proj.weight`` = this rank's rows of gate, then the same rows of up) and a
    row-parallel ``down_proj``. ``activation``: ``"silu"`` (SwiGLU, the default) or
    ``"gelu_pytorch_tanh"`` (GeGLU with the tanh approximation, as Gemma; HF's name for
    ``F.gelu(x, approximate="tanh")``); both run as one fused C++ op on CPUs."""

    ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool = False, *, dtype: torch.dtype, device,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        if activation not in self.ACTIVATIONS:
            raise ModelLoadError(
                f"MLP activation {activation!r} is not supported; supported: {', '.join(self.ACTIVATIONS)}"
            )
        self.activation = activation
        tp = get_tp()
        start, end = shard_range(intermediate_size, tp.rank, tp.size)
        self.intermediate_size = end - start  # this rank's share
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size,
            {"gate_proj": intermediate_size, "up_proj": intermediate_size},
            {"gate_proj": (start, end), "up_proj": (start, end)},
            bias,
            dtype=dtype,
            device=device,
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, (start, end), dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        ops = cpu_layer_ops.enabled(gate_up)
        if self.activation != "silu":
            if ops is not None and gate_up.dim() == 2:
                return self.down_proj(ops.gelu_tanh_and_mul(gate_up))
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        if ops is not None and gate_up.dim() == 2:
            return self.down_proj(ops.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


# ---- attention -------------------------------------------------------------------------------


class Attention(nn.Module):
    """Fused QKV projection, rotary, the backend's paged attention, output projection.

    ``qkv_proj.weight`` = rows of this rank's q heads (``num_heads * head_dim``, the local
    count), then its k heads, then its v heads (``num_kv_heads * head_dim`` each); ``o_proj`` is
    row-parallel over the same q heads. The attention itself (KV write + attend) is always
    ``backend.forward(q, k, v, kv_cache, attn_metadata)``, on the local heads only.

    Per-layer settings (``paged.core.attention.AttentionSettings``): ``sliding_window`` (a query
    at position p sees keys at positions > p - sliding_window, as HF does), ``logits_soft_cap``
    (scores = cap * tanh(scores / cap) before the softmax) and ``scale`` (None: head_dim ** -0.5;
    a scale equal to that is the default too). A layer with any of them passes
    ``settings=self.attn_settings`` to ``backend.forward``; the backend's support is checked
    here, when the model is built (``ConfigError`` naming backend, setting and value). A subclass
    that writes its own forward calls ``self.backend.forward(q, k, v, kv_cache, attn_metadata,
    **self._settings_kwargs)`` (empty for the default, so older backends keep working).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        backend: Any,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        scale: float | None = None,
        dtype: torch.dtype,
        device,
    ) -> None:
        super().__init__()
        if scale is not None and scale == head_dim**-0.5:
            scale = None  # the default: a backend need not declare the feature for it
        self.attn_settings = AttentionSettings(sliding_window, logits_soft_cap, scale)
        check_backend_supports(backend, self.attn_settings)
        # what forward passes to the backend: nothing for the default (older backends take no settings)
        self._settings_kwargs = {} if self.attn_settings.is_default else {"settings": self.attn_settings}
        tp = get_tp()
        shard: HeadShard = shard_heads(num_heads, num_kv_heads, tp.rank, tp.size)
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        d = head_dim
        kv_rows = (shard.kv_start * d, shard.kv_end * d)
        self.qkv_proj = MergedColumnParallelLinear(
            hidden_size,
            {"q_proj": num_heads * d, "k_proj": num_kv_heads * d, "v_proj": num_kv_heads * d},
            {"q_proj": (shard.q_start * d, shard.q_end * d), "k_proj": kv_rows, "v_proj": kv_rows},
            qkv_bias,
            dtype=dtype,
            device=device,
        )
        self.o_proj = RowParallelLinear(
            num_heads * d, hidden_size, o_bias, (shard.q_start * d, shard.q_end * d), dtype=dtype, device=device
        )
        self.rotary = rotary  # one instance shared by all layers (buffers only, no weights)
        self.backend = backend  # not an nn.Module: holds no parameters

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: Any,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k, cos_sin)
        out = self.backend.forward(q, k, v, kv_cache, attn_metadata, **self._settings_kwargs)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


# The methods of these layers as defined above, recorded before anything can patch them:
# ``paged.models.direct_decoder`` does their arithmetic without calling them, and only while each
# class still has these (a researcher's patch of one makes the model run its modules).
STOCK_METHODS: dict[tuple[type, str], Any] = {(cls, name): getattr(cls, name) for cls, name in [
    (Attention, "forward"), (RMSNorm, "forward"), (GatedMLP, "forward"), (RotaryEmbedding, "forward"),
    (RotaryEmbedding, "_rotate_both"), (MergedColumnParallelLinear, "forward"),
    (MergedColumnParallelLinear, "_linear"), (RowParallelLinear, "forward"), (RowParallelLinear, "_linear"),
]}
