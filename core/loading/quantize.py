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
from paged.core.loading.gguf import BLOCK_FIELDS, BLOCK_SCALES_FILE
from paged.core.loading.startup_times import phase
from paged.core.quantization import AUTO, NONE, BlockScales, QuantizationMethodSpec, QuantizedWeight, choose_auto

logger = logging.getLogger("paged")


def load_block_scales(model_dir: str | Path) -> dict[str, BlockScales]:
    """Checkpoint name -> its block scales (with the codes, where the conversion stored them),
    for the weights stored block-quantized ({} if none)."""
    from safetensors import safe_open

    from paged.core.loading.gguf_blocks import TYPES

    path = Path(model_dir) / BLOCK_SCALES_FILE
    if not path.is_file():
        return {}
    out: dict[str, BlockScales] = {}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        kinds = json.loads((f.metadata() or {}).get("kinds", "{}"))
        stored = set(f.keys())
        for name, kind in kinds.items():
            t = TYPES.get(kind)
            fields = {field: f.get_tensor(f"{name}.{field}") for field in BLOCK_FIELDS if f"{name}.{field}" in stored}
            out[name] = BlockScales(kind, block=t.group if t else 32,
                                    super_block=t.super_block if t and "super_scale" in fields else None, **fields)
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


class _RowsOf:
    """A part's slice as a whole weight of its own (its cache file's name)."""

    dim = 0
    dest_start = 0

    def __init__(self, s: Any) -> None:
        self.src_start, self.length = s.src_start, s.length


class RowStackedWeight:
    """Row blocks of one weight quantized separately (a fused projection whose parts a
    checkpoint stores as different block kinds): ``x W^T`` is the parts' outputs side by side."""

    def __init__(self, parts: list[QuantizedWeight]) -> None:
        self.parts = parts
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = torch.cat([p.linear(x, None) for p in self.parts], dim=-1)
        return out if bias is None else out + bias

    def native_gemm(self) -> tuple[Any, list[tuple]] | None:
        """The parts' (``GGUFWeight.native_gemm``) in order, where every part has one and they share
        a kernel: ``linear`` concatenates their outputs, as a native caller must."""
        found = [getattr(p, "native_gemm", lambda: None)() for p in self.parts]
        if any(f is None for f in found) or len({id(f[0]) for f in found}) != 1:
            return None
        return found[0][0], [part for f in found for part in f[1]]

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dequantize()[ids]

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts], dim=0)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)


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
        """The block scales of ``weight`` assembled like its rows (fused projections) or cut
        like its columns (a row-parallel shard); None unless every part has them, of one kind,
        and the cut falls on block boundaries."""
        parts = []
        for name, s in slices.items():
            b = self.scales.get(name)
            if b is None:
                return None
            if s.dim == 1:  # the columns [src_start, +length) of the whole rows
                if len(slices) != 1 or s.dest_start != 0:
                    return None
                b = b.columns(s.src_start, s.length)
                if b is None:
                    return None
                parts.append((b, 0))
            else:
                parts.append((b.rows(s.src_start, s.length), s.dest_start))
        if not parts or len({b.kind for b, _ in parts}) != 1:
            return None
        stacked = BlockScales.stack(parts, weight.shape[0])
        if stacked is None or stacked.scale.shape[1] * stacked.block != weight.shape[1]:
            return None
        return stacked

    def __call__(self, weight: torch.Tensor, slices: dict[str, Any]) -> QuantizedWeight | None:
        with phase("quantize"):
            return self._quantize(weight, slices)

    def _method_for(self, scales: BlockScales | None) -> str | None:
        return self._method_for_kind(scales.kind if scales is not None else None)

    def _method_for_kind(self, kind: str | None) -> str | None:
        if kind is not None:
            return next((n for n, (spec, _) in self.methods.items() if kind in spec.keeps), self.default)
        return self.default

    def _quantize(self, weight: torch.Tensor, slices: dict[str, Any]) -> QuantizedWeight | None:
        cached = self._read_before_stacking(weight, slices)
        if cached is not None:
            return cached
        scales = self._stacked_scales(weight, slices)
        if scales is None and (rows := self._row_parts(weight, slices)) is not None:
            return self._quantize_row_parts(weight, rows)
        name = self._method_for(scales)
        out = self._quantize_one(name, weight, slices, scales)
        if out is not None:
            self.counts[name] = self.counts.get(name, 0) + 1
        else:
            self.left_dense.extend(slices)
        return out

    def _read_before_stacking(self, weight: torch.Tensor, slices: dict[str, Any]) -> QuantizedWeight | None:
        """The weight read back from the cache without assembling its block scales first (that
        assembly is most of a warm start's quantize time), when all its parts are of one kind.

        Exact: a file exists only where that method quantized this weight with these slices,
        which it does again whenever the scales stack; where they do not, the method chosen is
        another one and this finds nothing."""
        if self.cache is None:
            return None
        kinds = {self.scales[n].kind if n in self.scales else None for n in slices}
        if len(kinds) != 1:
            return None
        name = self._method_for_kind(kinds.pop())
        if name is None:
            return None
        spec, options = self.methods[name]
        out = self._read(self.cache / _weight_file(name, weight, slices), spec, options)
        if out is not None:
            self.cache_hits += 1
            self.counts[name] = self.counts.get(name, 0) + 1
        return out

    def _quantize_one(self, name: str | None, weight: torch.Tensor, slices: dict[str, Any],
                      scales: BlockScales | None) -> QuantizedWeight | None:
        if name is None:
            return None
        spec, options = self.methods[name]
        path = self.cache / _weight_file(name, weight, slices) if self.cache is not None else None
        out = self._read(path, spec, options)
        if out is not None:
            self.cache_hits += 1
            return out
        try:
            out = spec.quantize(weight, scales, options)
        except Exception as e:
            raise ModelLoadError(f"model.quantization: method {name!r} failed on a {tuple(weight.shape)} weight: {e}") from e
        if out is not None and path is not None:
            self._write(path, out)
        return out

    def _row_parts(self, weight: torch.Tensor, slices: dict[str, Any]) -> list[tuple[str, Any, BlockScales]] | None:
        """A fused weight whose checkpoint parts are stored as different block kinds (a GGUF's
        Q4_K q and k with a Q6_K v): ``(name, slice, scales)`` per part in row order, or None."""
        if len(slices) < 2 or any(s.dim != 0 or name not in self.scales for name, s in slices.items()):
            return None
        parts = sorted(slices.items(), key=lambda item: item[1].dest_start)
        if sum(s.length for _, s in parts) != weight.shape[0]:
            return None
        return [(name, s, self.scales[name].rows(s.src_start, s.length)) for name, s in parts]

    def _quantize_row_parts(self, weight: torch.Tensor, rows: list[tuple[str, Any, BlockScales]]) -> QuantizedWeight | None:
        """Each part by the method that keeps its kind, held together as one weight (None, and
        the whole weight stays dense, if any part would stay dense)."""
        parts = []
        for name, s, scales in rows:
            method = self._method_for(scales)
            part = weight.narrow(0, s.dest_start, s.length)
            out = self._quantize_one(method, part, {name: _RowsOf(s)}, scales)
            if out is None:
                self.left_dense.extend(name for name, _, _ in rows)
                return None
            parts.append(out)
        first = self._method_for(rows[0][2])
        self.counts[first] = self.counts.get(first, 0) + 1
        return RowStackedWeight(parts)

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
        # each kind of block goes to the default when it keeps it, else to the first available
        # method that does; the default comes first, so the Quantizer asks it first
        chosen = [default]
        for kind in kinds:
            if kind not in methods[default].keeps:
                home = next((n for n, s in methods.items() if kind in s.keeps and s.is_available(device, dtype)[0]), None)
                if home is not None and home not in chosen:
                    chosen.append(home)
        logger.info("quantization: auto -> %s (checkpoint blocks: %s)", ", ".join(chosen),
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
