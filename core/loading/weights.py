"""Loading a checkpoint into a model's (possibly fused, possibly tensor-parallel) parameters.

Public helpers for model plugins (see ``paged.core.model``, step 4). A parameterised module
either holds whole checkpoint tensors under its own names (``whole_parameters``, the default) or
declares ``checkpoint_slices(name) -> {checkpoint_name: CheckpointSlice}``: which slice of which
checkpoint tensor fills which slice of which parameter. A fused QKV projection declares three
entries, a row-parallel layer on rank r the columns it holds. ``load_checkpoint`` then copies
exactly those slices and names every missing, unexpected and mis-shaped tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from paged.core.errors import ModelLoadError


@dataclass(frozen=True)
class CheckpointSlice:
    """One checkpoint tensor's destination: ``param.narrow(dim, dest_start, length)`` is filled
    from ``tensor.narrow(dim, src_start, length)``; the checkpoint tensor must be ``full_shape``."""

    param: nn.Parameter
    dim: int
    dest_start: int
    src_start: int
    length: int
    full_shape: tuple[int, ...]

    @classmethod
    def whole(cls, param: nn.Parameter) -> "CheckpointSlice":
        return cls(param, 0, 0, 0, param.shape[0], tuple(param.shape))


def whole_parameters(name: str, module: nn.Module) -> dict[str, CheckpointSlice]:
    """The default: each of ``module``'s own parameters is one whole checkpoint tensor."""
    prefix = f"{name}." if name else ""
    return {f"{prefix}{kind}": CheckpointSlice.whole(p) for kind, p in module.named_parameters(recurse=False)}


def expected_tensors(model: nn.Module) -> dict[str, CheckpointSlice]:
    """Checkpoint name -> the slice of a parameter it fills, over every module of ``model``.

    A parameter shared by two modules (a tied LM head holds the embedding's) is expected once,
    under the first module that holds it."""
    expected: dict[str, CheckpointSlice] = {}
    owned: set[int] = set()
    for name, module in model.named_modules():
        declare = getattr(module, "checkpoint_slices", None)
        slices = declare(name) if declare is not None else whole_parameters(name, module)
        expected.update((k, w) for k, w in slices.items() if id(w.param) not in owned)
        owned.update(id(p) for p in module.parameters(recurse=False))
    return expected


def _listing(items: list[str], limit: int = 12) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... and {len(items) - limit} more" if len(items) > limit else "")


def load_checkpoint(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    architecture: str,
    ignore: Callable[[str], bool] = lambda name: False,
    rename: Callable[[str], str] = lambda name: name,
) -> None:
    """Copy the checkpoint's tensors into ``model`` (converting dtype and device).

    ``rename`` maps a checkpoint name to the model's name (e.g. strip a prefix); ``ignore``
    skips a (renamed) name entirely (buffers such as rotary tables, a tied head). Raises
    ModelLoadError naming every missing tensor, unexpected tensor and shape mismatch.
    """
    expected = expected_tensors(model)
    loaded: set[str] = set()
    unexpected: list[str] = []
    mismatched: list[str] = []
    with torch.no_grad():
        for name, tensor in weights:
            name = rename(name)
            if ignore(name):
                continue
            target = expected.get(name)
            if target is None:
                unexpected.append(name)
                continue
            loaded.add(name)  # a mis-shaped tensor is reported as a mismatch, not as missing
            if tuple(tensor.shape) != target.full_shape:
                mismatched.append(f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects {target.full_shape}")
                continue
            dest = target.param.narrow(target.dim, target.dest_start, target.length)
            dest.copy_(tensor.narrow(target.dim, target.src_start, target.length))
    missing = [name for name in expected if name not in loaded]
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"missing tensors ({len(missing)}): {_listing(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors ({len(unexpected)}): {_listing(unexpected)}")
        if mismatched:
            parts.append(f"shape mismatches ({len(mismatched)}): {_listing(mismatched, 6)}")
        raise ModelLoadError(f"{architecture}: the checkpoint does not fit the model: " + "; ".join(parts))


def split_fused_rows(
    weights: Iterable[tuple[str, torch.Tensor]], fused: dict[str, list[tuple[str, int]]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint that stores projections fused by rows (Phi-3's ``qkv_proj`` and
    ``gate_up_proj``) as the separate tensors a model's layers declare (``q_proj``, ``k_proj``,
    ``v_proj``; ``gate_proj``, ``up_proj``), so each layer's ``checkpoint_slices`` (and so its
    tensor-parallel share and quantization) apply unchanged.

    ``fused`` maps a module name to its parts in row order, ``(part name, rows)``: the tensor
    ``{prefix}{module}.{kind}`` (weight or bias) is yielded as ``{prefix}{part}.{kind}`` for each
    part, narrowed along rows (views: the rows of a memory-mapped tensor that this rank never
    copies are never read). Every other tensor passes unchanged, so a checkpoint already split
    loads too. Raises ModelLoadError when a fused tensor's rows are not the sum of its parts'.
    """
    for name, tensor in weights:
        base, dot, kind = name.rpartition(".")
        prefix, _, module = base.rpartition(".")
        parts = fused.get(module) if dot else None
        if parts is None:
            yield name, tensor
            continue
        rows = sum(n for _, n in parts)
        if tensor.dim() < 1 or tensor.shape[0] != rows:
            raise ModelLoadError(
                f"{name}: a fused {module} of shape {tuple(tensor.shape)}, expected {rows} rows "
                f"({' + '.join(f'{part} {n}' for part, n in parts)})"
            )
        start = 0
        for part, n in parts:
            yield f"{prefix}.{part}.{kind}" if prefix else f"{part}.{kind}", tensor.narrow(0, start, n)
            start += n
