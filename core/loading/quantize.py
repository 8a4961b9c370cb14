"""Choosing and applying a weight-only quantization method (``model.quantization``).

The model is built and loaded dense first (in its dtype); then each linear weight, the LM head
and the embedding are handed to ``Quantizer``, which returns the method's ``QuantizedWeight``
(or None: the weight stays dense). Block-quantized checkpoints (a GGUF converted by
``paged.core.loading.gguf``) carry each weight's block scales in ``gguf_block_scales.safetensors``;
they are stacked like the weights of the fused projections and passed along, so a method that
can hold them keeps the checkpoint's codes.

Packed-weight cache: quantizing (codes, packing, the dense copy) is most of a start-up's work
on the CPU, and its result depends only on the inputs, so each quantized weight a method can
store (``QuantizationMethodSpec.restore``) is written once as a safetensors file and read back
by every later start (never pickle). The folder's key is the checkpoint's files (path, size,
mtime), the dtype and device, the methods with their ``cache_version`` and options, and the
torch version; a file's name is its weight's checkpoint slices and shape; ``restore`` itself
refuses a layout this process cannot use (the int4 kernel's or torch's). The folder sits beside
a converted GGUF model (paged's own directory) and under ``<paged cache>/quantized`` for any
other model; ``PAGED_QUANTIZED_CACHE=0`` turns the cache off. A folder that cannot be written
only costs the speed-up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from paged.core.errors import ConfigError, ModelLoadError
from paged.core.loading import gguf
from paged.core.loading.gguf import BLOCK_SCALES_FILE
from paged.core.loading.startup_times import phase
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
    from paged.core.config import validate_options

    return validate_options(spec, options, "model.quantization_options")


CACHE_ENV = "PAGED_QUANTIZED_CACHE"
_CACHE_FORMAT = "1"  # bump when the file naming or the key below changes


def cache_folder(model_dir: str | Path, methods: dict[str, tuple[QuantizationMethodSpec, Any]],
                 dtype: torch.dtype, device: torch.device) -> Path | None:
    """Where the packed weights of this model, methods, options, dtype and torch live (None:
    the cache is off, or a method cannot restore its weights)."""
    if os.environ.get(CACHE_ENV, "1") == "0" or not methods:
        return None
    if any(spec.restore is None for spec, _ in methods.values()):
        return None
    model_dir = Path(model_dir).resolve()
    files = []
    for path in sorted(model_dir.glob("*.safetensors")):
        stat = path.stat()
        files.append([path.name, stat.st_size, stat.st_mtime_ns])
    key = json.dumps({
        "format": _CACHE_FORMAT, "model": str(model_dir), "files": files, "dtype": str(dtype),
        "device": torch.device(device).type, "torch": [torch.__version__, str(torch.version.git_version)],
        "methods": {name: [spec.cache_version, options.model_dump_json() if options is not None else None]
                    for name, (spec, options) in sorted(methods.items())},
    }, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = gguf.cache_dir().resolve()
    if model_dir.is_relative_to(root):  # a converted GGUF: paged's own directory
        return model_dir / "quantized" / digest
    return root / "quantized" / digest


def _weight_file(name: str, weight: torch.Tensor, slices: dict[str, Any]) -> str:
    parts = [name, str(tuple(weight.shape)), str(weight.dtype)]
    parts += [f"{n}:{s.dim}:{s.dest_start}:{s.src_start}:{s.length}" for n, s in sorted(slices.items())]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24] + ".safetensors"


class Quantizer:
    """``quantizer(weight, slices) -> QuantizedWeight | None`` for one weight, given the
    checkpoint slices that filled it (``paged.models.layers.CheckpointSlice``: name -> slice).
    With ``cache`` (a folder, see ``cache_folder``) a weight quantized once is read back."""

    def __init__(self, methods: dict[str, tuple[QuantizationMethodSpec, Any]], default: str | None,
                 scales: dict[str, BlockScales], cache: Path | None = None) -> None:
        self.methods = methods  # name -> (spec, validated options)
        self.default = default  # the method for weights without block scales (None: stay dense)
        self.scales = scales
        self.cache = cache
        self.cache_hits = 0  # weights read back from the cache
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
        with phase("quantize"):
            return self._quantize(weight, slices)

    def _quantize(self, weight: torch.Tensor, slices: dict[str, Any]) -> QuantizedWeight | None:
        scales = self._stacked_scales(weight, slices)
        name = self.default
        if scales is not None:
            name = next((n for n, (spec, _) in self.methods.items() if scales.kind in spec.keeps), name)
        if name is None:
            return None
        spec, options = self.methods[name]
        path = self.cache / _weight_file(name, weight, slices) if self.cache is not None else None
        out = self._read(path, spec, options)
        if out is not None:
            self.cache_hits += 1
        else:
            try:
                out = spec.quantize(weight, scales, options)
            except Exception as e:
                raise ModelLoadError(f"model.quantization: method {name!r} failed on a {tuple(weight.shape)} weight: {e}") from e
            if out is not None and path is not None:
                self._write(path, out)
        if out is not None:
            self.counts[name] = self.counts.get(name, 0) + 1
        else:
            self.left_dense.extend(slices)
        return out

    @staticmethod
    def _read(path: Path | None, spec: QuantizationMethodSpec, options: Any) -> QuantizedWeight | None:
        if path is None or not path.is_file():
            return None
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                tensors = {k: f.get_tensor(k) for k in f.keys()}
                metadata = f.metadata() or {}
            return spec.restore(tensors, metadata, options)
        except Exception as e:  # a damaged or foreign file: quantize again (and overwrite it)
            logger.debug("packed-weight cache: cannot use %s (%s)", path, e)
            return None

    @staticmethod
    def _write(path: Path, weight: QuantizedWeight) -> None:
        """Write atomically (a temporary file renamed into place): a concurrent reader sees the
        whole file or none."""
        from safetensors.torch import save_file

        try:
            tensors, metadata = weight.cache_tensors()
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            os.close(fd)
            try:
                save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
        except Exception as e:  # read-only or full disk: the weights are quantized at every start instead
            logger.debug("packed-weight cache: cannot write %s (%s)", path, e)


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
        chosen_methods = {n: (methods[n], _validated_options(methods[n], {})) for n in chosen}
        return Quantizer(chosen_methods, default, scales, cache_folder(model_dir, chosen_methods, dtype, device))
    spec = registry.quantization_method(setting)
    ok, reason = spec.is_available(device, dtype)
    if not ok:
        raise ConfigError(f"model.quantization: {setting!r} cannot run here: {reason}")
    chosen_methods = {setting: (spec, _validated_options(spec, model_cfg.quantization_options))}
    return Quantizer(chosen_methods, setting, {name: b for name, b in scales.items() if b.kind in spec.keeps},
                     cache_folder(model_dir, chosen_methods, dtype, device))
