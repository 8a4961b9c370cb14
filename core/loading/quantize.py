"""Choosing and applying a weight-only quantization method (``model.quantization``).

The model is built and loaded dense first (in its dtype); then each linear weight, the LM head
and the embedding are handed to ``Quantizer``, which returns the method's ``QuantizedWeight``
(or None: the weight stays dense). Block-quantized checkpoints (a GGUF converted by
``paged.core.loading.gguf``) carry each weight's block scales in ``gguf_block_scales.safetensors``;
they are stacked like the weights of the fused projections and passed along, so a method that
can hold them keeps the checkpoint's codes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from paged.core.errors import ConfigError, ModelLoadError
from paged.core.loading.gguf import BLOCK_SCALES_FILE
from paged.core.quantization import AUTO, NONE, BlockScales, QuantizationMethodSpec, QuantizedWeight, choose_auto

logger = logging.getLogger("paged")


def load_block_scales(model_dir: str | Path) -> dict[str, BlockScales]:
    """Checkpoint name -> its block scales, for the weights stored block-quantized ({} if none)."""
    from safetensors import safe_open

    path = Path(model_dir) / BLOCK_SCALES_FILE
    if not path.is_file():
        return {}
    out: dict[str, BlockScales] = {}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        kinds = json.loads((f.metadata() or {}).get("kinds", "{}"))
        for name, kind in kinds.items():
            out[name] = BlockScales(kind, f.get_tensor(f"{name}.scale"), f.get_tensor(f"{name}.offset"))
    return out


def _validated_options(spec: QuantizationMethodSpec, options: dict[str, Any]) -> Any:
    from paged.core.config import _validate_options

    return _validate_options(spec, options, "model.quantization_options")


class Quantizer:
    """``quantizer(weight, slices) -> QuantizedWeight | None`` for one weight, given the
    checkpoint slices that filled it (``paged.models.layers.CheckpointSlice``: name -> slice)."""

    def __init__(self, methods: dict[str, tuple[QuantizationMethodSpec, Any]], default: str | None,
                 scales: dict[str, BlockScales]) -> None:
        self.methods = methods  # name -> (spec, validated options)
        self.default = default  # the method for weights without block scales (None: stay dense)
        self.scales = scales
        self.counts: dict[str, int] = {}  # method -> weights it quantized (quantize calls that returned one)
        self.left_dense: list[str] = []  # checkpoint names of weights a method left dense (returned None)

    def _stacked_scales(self, weight: torch.Tensor, slices: dict[str, Any]) -> BlockScales | None:
        """The block scales of ``weight`` assembled like its rows (None unless every part has
        them, of one kind, and the parts stack by rows)."""
        parts = [(self.scales.get(name), s) for name, s in slices.items()]
        if not parts or any(b is None or s.dim != 0 for b, s in parts) or len({b.kind for b, _ in parts}) != 1:
            return None
        kind, block = parts[0][0].kind, parts[0][0].block
        scale = torch.empty(weight.shape[0], weight.shape[1] // block)
        offset = torch.empty_like(scale)
        for b, s in parts:
            rows = b.rows(s.src_start, s.length)
            scale[s.dest_start : s.dest_start + s.length] = rows.scale
            offset[s.dest_start : s.dest_start + s.length] = rows.offset
        return BlockScales(kind, scale, offset, block)

    def __call__(self, weight: torch.Tensor, slices: dict[str, Any]) -> QuantizedWeight | None:
        scales = self._stacked_scales(weight, slices)
        name = self.default
        if scales is not None:
            name = next((n for n, (spec, _) in self.methods.items() if scales.kind in spec.keeps), name)
        if name is None:
            return None
        spec, options = self.methods[name]
        try:
            out = spec.quantize(weight, scales, options)
        except Exception as e:
            raise ModelLoadError(f"model.quantization: method {name!r} failed on a {tuple(weight.shape)} weight: {e}") from e
        if out is not None:
            self.counts[name] = self.counts.get(name, 0) + 1
        else:
            self.left_dense.extend(slices)
        return out


def make_quantizer(model_cfg: Any, registry: Any, model_dir: str | Path, device: torch.device,
                   dtype: torch.dtype) -> Quantizer | None:
    """The quantizer for ``model.quantization`` (None for ``none``, or ``auto`` that finds
    nothing worth keeping). An explicit method must be available on this device and dtype."""
    setting = model_cfg.quantization
    if setting == NONE:
        return None
    scales = load_block_scales(model_dir)
    kinds: dict[str, int] = {}
    for b in scales.values():
        kinds[b.kind] = kinds.get(b.kind, 0) + 1
    methods = registry.quantization_methods
    if setting == AUTO:
        if model_cfg.quantization_options:
            raise ConfigError("model.quantization_options: set model.quantization to a method to give it options")
        if dtype != torch.bfloat16:
            logger.info("quantization: auto -> none (the quantized kernels pay off with bfloat16 activations; dtype is %s)",
                        str(dtype).removeprefix("torch."))
            return None
        default = choose_auto(methods, kinds, device, dtype)
        if default == NONE:
            logger.info("quantization: auto -> none (the checkpoint is not stored block-quantized)")
            return None
        # each kind of block goes to the method that keeps it; the rest to the default
        chosen = {default} | {n for n, s in methods.items() if set(s.keeps) & set(kinds) and s.is_available(device, dtype)[0]}
        logger.info("quantization: auto -> %s (checkpoint blocks: %s)", ", ".join(sorted(chosen)),
                    ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))
        return Quantizer({n: (methods[n], _validated_options(methods[n], {})) for n in chosen}, default, scales)
    spec = registry.quantization_method(setting)
    ok, reason = spec.is_available(device, dtype)
    if not ok:
        raise ConfigError(f"model.quantization: {setting!r} cannot run here: {reason}")
    return Quantizer({setting: (spec, _validated_options(spec, model_cfg.quantization_options))}, setting, {
        name: b for name, b in scales.items() if b.kind in spec.keeps
    })
