"""Reading a PEFT LoRA adapter for the model the engine holds (``paged.core.lora``).

An adapter folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (PEFT's
``save_pretrained``; a pickled ``adapter_model.bin`` is never loaded). Each tensor is named
``base_model.model.<module>.lora_A.weight`` (``[r, in]``) or ``...lora_B.weight`` (``[out, r]``),
``<module>`` the HF name of a linear layer (``model.layers.3.self_attn.q_proj``). The model's
linear layers say which checkpoint projections they hold (``checkpoint_slices``, the same
declaration weight loading uses): a fused QKV holds ``q_proj``, ``k_proj`` and ``v_proj`` as three
parts, and under tensor parallelism each rank its rows or columns of them. ``LoRATargets`` maps
each projection's HF name to those parts once per model; ``load_adapter`` checks an adapter against
it and cuts each ``A``/``B`` pair the way the base weight is cut, with the scaling folded into
``B`` (``lora_alpha / r``; ``lora_alpha / sqrt(r)`` with ``use_rslora``; ``rank_pattern`` and
``alpha_pattern`` per module as PEFT matches them). A checkpoint that stores a fused projection
(Phi-3's ``qkv_proj``, ``gate_up_proj``) is split into its parts by the model's ``fused_parts``.

Every problem is an ``InvalidRequestError`` naming the adapter, the file and the field or tensor
(and what would be accepted), raised when the adapter is registered, before any request uses it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paged.core.errors import InvalidRequestError
from paged.core.lora import LoRARequest
from paged.core.loading.weights import whole_parameters

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# adapter_config.json fields that change what an adapter computes, and the one value paged takes
_UNSUPPORTED_CONFIG = {
    "use_dora": (False, "DoRA adapters are not supported (a weight-decomposed adapter needs its magnitude vector)"),
    "bias": ("none", "adapters that train biases are not supported"),
    "lora_bias": (False, "adapters with a bias on lora_B are not supported"),
    "fan_in_fan_out": (False, "fan_in_fan_out (Conv1D layers) is not supported"),
    "layer_replication": (None, "layer replication is not supported"),
    "trainable_token_indices": (None, "trained token embeddings are not supported"),
    "target_parameters": (None, "adapters on parameters (not modules) are not supported"),
    "use_qalora": (False, "QA-LoRA is not supported"),
    "alora_invocation_tokens": (None, "activated LoRA (aLoRA) is not supported"),
}
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<kind>lora_A|lora_B)(?:\.[^.]+)?\.weight$")


@dataclass(frozen=True)
class TargetPart:
    """One checkpoint projection's share in a linear layer of this rank: ``dim`` 0 = this rank
    holds its output rows ``[src_start, src_start + length)``, at the layer's output columns
    ``[dest_start, dest_start + length)``; ``dim`` 1 = its input columns (a row-parallel layer)."""

    module: str  # the layer's name in the model
    part: int  # which of the layer's projections (row block of its adapter slots)
    dim: int
    dest_start: int
    src_start: int
    length: int
    full_out: int
    full_in: int


@dataclass
class LoadedAdapter:
    """An adapter cut for this rank: per layer name, its parts as ``(part, a [r, in_local],
    b [r, out_cols], out_start)`` with ``b`` = B's rows of those output columns, transposed, times
    the scaling; in the model's dtype, on the CPU."""

    request: LoRARequest
    rank: int
    layers: dict[str, list[tuple[int, torch.Tensor, torch.Tensor, int]]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for parts in self.layers.values() for _, a, b, _ in parts)


class LoRATargets:
    """The model's linear layers that adapters may target, by the HF name of each checkpoint
    projection they hold. A layer takes adapters when its class has a ``lora`` attribute (as
    ``paged.models.layers.Linear`` and its subclasses do: their forward adds ``lora``'s adapters),
    except the experts of a mixture of experts (each runs on the rows routed to it, not the whole
    batch)."""

    def __init__(self, model: nn.Module) -> None:
        self.parts: dict[str, list[TargetPart]] = {}
        self.layers: dict[str, tuple[nn.Module, int]] = {}  # layer name -> (module, number of parts)
        self.fused: dict[str, list[tuple[str, int]]] = {}
        fused_parts = getattr(model, "fused_parts", None)
        if callable(fused_parts):
            self.fused = dict(fused_parts())
        for name, module in model.named_modules():
            if not hasattr(type(module), "lora") or not hasattr(module, "weight") or ".experts." in f".{name}.":
                continue
            declare = getattr(module, "checkpoint_slices", None)
            slices = declare(name) if declare is not None else whole_parameters(name, module)
            weights = [(k, s) for k, s in slices.items() if k.endswith(".weight") and s.param is module.weight]
            for part, (key, s) in enumerate(weights):
                full_out, full_in = s.full_shape
                self.parts.setdefault(key[: -len(".weight")], []).append(
                    TargetPart(name, part, s.dim, s.dest_start, s.src_start, s.length, full_out, full_in))
            if weights:
                self.layers[name] = (module, len(weights))

    def leaf_names(self) -> list[str]:
        """The projections' short names (``q_proj``, ``down_proj``, ...), for messages."""
        return sorted({n.rpartition(".")[2] for n in self.parts} | set(self.fused))

    def resolve(self, module: str) -> list[tuple[str, int, int]] | None:
        """An adapter's module as ``(projection, first row of B, rows)`` for each projection it
        covers: itself, or a fused checkpoint module's parts; None if the model has no such layer."""
        if module in self.parts:
            return [(module, 0, self.parts[module][0].full_out)]
        prefix, _, leaf = module.rpartition(".")
        if leaf not in self.fused:
            return None
        out, row = [], 0
        for part, rows in self.fused[leaf]:
            name = f"{prefix}.{part}" if prefix else part
            if name not in self.parts:
                return None
            out.append((name, row, rows))
            row += rows
        return out


def _fail(request: LoRARequest, where: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}): {where}: {message}")


def read_adapter_config(request: LoRARequest) -> dict[str, Any]:
    """``adapter_config.json`` of the adapter, checked: a LoRA adapter, with nothing paged does
    not compute."""
    folder = Path(request.lora_path)
    if not folder.is_dir():
        raise _fail(request, "lora_path", "no such folder; give the folder PEFT's save_pretrained wrote")
    path = folder / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _fail(request, ADAPTER_CONFIG, "missing; a PEFT adapter folder has adapter_config.json and "
                    "adapter_model.safetensors") from None
    except (OSError, ValueError) as e:
        raise _fail(request, ADAPTER_CONFIG, f"cannot be read as JSON ({e})") from None
    if not isinstance(config, dict):
        raise _fail(request, ADAPTER_CONFIG, f"must hold a JSON object, got {type(config).__name__}")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _fail(request, f"{ADAPTER_CONFIG} field peft_type", f"{peft_type!r} is not supported; only 'LORA'")
    modules_to_save = config.get("modules_to_save")
    if modules_to_save:
        raise _fail(request, f"{ADAPTER_CONFIG} field modules_to_save",
                    f"{modules_to_save!r}: fully trained modules beside the adapter are not supported; "
                    "only adapters with modules_to_save null or [] are")
    for key, (accepted, why) in _UNSUPPORTED_CONFIG.items():
        value = config.get(key, accepted)
        if value != accepted and not (accepted is None and value in ({}, [])):
            raise _fail(request, f"{ADAPTER_CONFIG} field {key}", f"{value!r}: {why} (accepted: {accepted!r})")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise _fail(request, f"{ADAPTER_CONFIG} field {key}", f"{value!r}; must be a number > 0")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise _fail(request, f"{ADAPTER_CONFIG} field {key}", "must be an object of module name: value")
    return config


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's per-module override: the first key that matches the end of ``module`` at a dot."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def load_adapter(request: LoRARequest, targets: LoRATargets, max_lora_rank: int, dtype: torch.dtype) -> LoadedAdapter:
    """Read, check and cut the adapter for this rank (see the module docstring)."""
    from safetensors import SafetensorError, safe_open

    if not isinstance(request.lora_int_id, int) or isinstance(request.lora_int_id, bool) or request.lora_int_id < 1:
        raise _fail(request, "lora_int_id", f"{request.lora_int_id!r}; must be an integer >= 1")
    config = read_adapter_config(request)
    folder = Path(request.lora_path)
    path = folder / ADAPTER_WEIGHTS
    if not path.is_file():
        pickled = " (adapter_model.bin is a pickle, which paged never loads: save it with safe_serialization)" \
            if (folder / "adapter_model.bin").exists() else ""
        raise _fail(request, ADAPTER_WEIGHTS, f"missing{pickled}")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                match = _TENSOR.match(key)
                if match is None:
                    kind = ("an embedding adapter (not supported)" if "lora_embedding" in key else
                            "DoRA's magnitude vector (DoRA is not supported)" if "lora_magnitude_vector" in key else
                            "not a lora_A/lora_B weight of a linear layer")
                    raise _fail(request, f"{ADAPTER_WEIGHTS} tensor {key}", kind)
                pairs.setdefault(match["module"], {})[match["kind"]] = f.get_tensor(key)
    except SafetensorError as e:
        raise _fail(request, ADAPTER_WEIGHTS, f"not a readable safetensors file ({e})") from None
    if not pairs:
        raise _fail(request, ADAPTER_WEIGHTS, "holds no lora_A/lora_B tensors")
    adapter = LoadedAdapter(request, rank=0)
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    for module, pair in sorted(pairs.items()):
        where = f"{ADAPTER_WEIGHTS} tensor {module}"
        if set(pair) != {"lora_A", "lora_B"}:
            missing = "lora_B" if "lora_A" in pair else "lora_A"
            raise _fail(request, f"{where}.{missing}.weight", "missing (every lora_A needs its lora_B)")
        projections = targets.resolve(module)
        if projections is None:
            raise _fail(request, f"{ADAPTER_CONFIG} field target_modules ({where})",
                        f"{module.rpartition('.')[2]!r} is not a linear layer of this model that LoRA applies to; "
                        f"accepted: {', '.join(targets.leaf_names())}")
        a, b = pair["lora_A"], pair["lora_B"]
        r = a.shape[0] if a.dim() == 2 else -1
        full_in = targets.parts[projections[0][0]][0].full_in
        full_out = sum(rows for _, _, rows in projections)
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != full_in or tuple(b.shape) != (full_out, r):
            raise _fail(request, where, f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the layer: "
                        f"expected lora_A [r, {full_in}] and lora_B [{full_out}, r] (a base model of another shape?)")
        expected_r = _pattern_value(rank_pattern, module, config["r"])
        if r != expected_r:
            raise _fail(request, where, f"rank {r} differs from the config's r / rank_pattern ({expected_r})")
        if r > max_lora_rank:
            raise _fail(request, where, f"rank {r} exceeds lora.max_lora_rank ({max_lora_rank}); raise "
                        f"--max-lora-rank to at least {r}")
        alpha = float(_pattern_value(alpha_pattern, module, config["lora_alpha"]))
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        b_scaled = b.float() * scaling
        for projection, row0, rows in projections:
            for t in targets.parts[projection]:
                if t.dim == 0:  # this rank's output rows of the projection, at its columns of the layer
                    a_part = a
                    b_part = b_scaled[row0 + t.src_start: row0 + t.src_start + t.length].T
                    out_start = t.dest_start
                else:  # a row-parallel layer: this rank's input columns; every output column
                    a_part = a[:, t.src_start: t.src_start + t.length]
                    b_part = b_scaled[row0: row0 + rows].T
                    out_start = 0
                adapter.layers.setdefault(t.module, []).append(
                    (t.part, a_part.to(dtype).contiguous(), b_part.to(dtype).contiguous(), out_start))
        adapter.rank = max(adapter.rank, r)
    return adapter
