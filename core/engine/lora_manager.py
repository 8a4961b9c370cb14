"""LoRA in the engine core (contract and layout: ``paged.core.lora``): the adapters held in memory,
the layers' adapter slots, and which slot each row of a step uses.

* **Adapters in memory** (``adapters``, least recently used first): read and checked by ``add``
  (``paged.core.loading.lora``) when the front-end registers an adapter or when a request names
  one that is not in memory, never during a step. At most ``lora.max_cpu_loras``: past that the
  least recently used adapter that no unfinished request uses is dropped (``in_use``, set by the
  engine core). ``remove`` forgets an adapter once no unfinished request uses it.
* **Slots**: each LoRA-capable linear layer (``LoRATargets``) holds ``max_loras`` slots. Before a
  step, ``prepare_step`` (rank 0) gives every adapter of the scheduled requests a slot: the one it
  is in, else an empty one, else the least recently used one no row of this step needs (the
  scheduler never puts more than ``max_loras`` adapters in one step), and returns the rows' slots
  and the slot loads; ``begin_step`` (every rank) copies the loaded adapters into their slots and
  publishes the rows' slots to the layers (``LoRABatch``), ``end_step`` withdraws them.

Invariants: ``slot_ids[s]`` is the id whose weights slot s holds (0: empty), and ``slot_of`` is its
inverse; an adapter in a slot is in ``adapters`` on every rank, or was dropped there without
changing its weights (an explicit ``remove`` also empties its slot).

Tensor parallelism: every rank holds its own cut of each adapter. Rank 0 sends each ``add`` and
``remove`` to the other ranks (``control_message``, one broadcast, between steps) and each step's
slot loads in ``StepInputs``; the other ranks apply them in the same order (``handle_control``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable

import numpy as np
import torch

from paged.core.errors import InvalidRequestError
from paged.core.loading.lora import LoadedAdapter, LoRATargets, load_adapter
from paged.core.lora import LoRABatch, LoRAKernelContext, LoRALayerWeights, LoRARequest

logger = logging.getLogger("paged")

CONTROL = -1  # StepInputs' first number (num_reqs) for a control message instead of a step
_ADD, _REMOVE = 1, 2


class LayerLoRA:
    """What a linear layer holds (``Linear.lora``): its slots, the step's batch, the kernel."""

    __slots__ = ("weights", "batch", "kernel")

    def __init__(self, weights: LoRALayerWeights, batch: LoRABatch, kernel) -> None:
        self.weights = weights
        self.batch = batch
        self.kernel = kernel


def resolve_lora_kernel(config, registry, device: torch.device, dtype: torch.dtype):
    """The kernel named by ``lora.kernel`` (auto: the available one with the highest priority),
    built for this model; an ``auto`` choice that fails to start falls back to ``torch``."""
    from paged.core.config import choose_available, validate_options

    name, kind = config.lora.kernel, device.type
    spec = choose_available(registry.lora_kernels, name, registry.lora_kernel, "lora.kernel", "kernel", kind)
    options = validate_options(spec, config.lora.options, "lora.options")
    context = LoRAKernelContext(kind, dtype, config.lora.max_loras, config.lora.max_lora_rank)
    try:
        kernel = spec.factory(options, context)
    except Exception as e:
        if name != "auto":
            raise
        fallback = registry.lora_kernels.get("torch")
        if fallback is None or fallback is spec:
            raise
        logger.warning("lora.kernel: %r failed to start (%s); using 'torch'", spec.name, e)
        spec, kernel = fallback, fallback.factory(None, context)
    return spec, kernel


class LoRAManager:
    def __init__(self, model: torch.nn.Module, config, kernel, dtype: torch.dtype, device: torch.device, tp) -> None:
        lora = config.lora
        self.max_loras = lora.max_loras
        self.max_lora_rank = lora.max_lora_rank
        self.capacity = lora.cpu_loras
        self.dtype = dtype
        self.device = device
        self.tp = tp
        self.targets = LoRATargets(model)
        self.batch = LoRABatch()
        self.layers: dict[str, LoRALayerWeights] = {}
        for name, (module, parts) in self.targets.layers.items():
            rows = parts * self.max_lora_rank
            weights = LoRALayerWeights(
                a=torch.zeros(self.max_loras, rows, module.in_features, dtype=dtype, device=device),
                b=torch.zeros(self.max_loras, rows, module.out_features, dtype=dtype, device=device),
                ranks=torch.zeros(self.max_loras, dtype=torch.int32), parts=parts, name=name,
            )
            self.layers[name] = weights
            module.lora = LayerLoRA(weights, self.batch, kernel)
        self.adapters: OrderedDict[int, LoadedAdapter] = OrderedDict()  # least recently used first
        self.removed: set[int] = set()  # forgotten once no unfinished request uses them
        self.slot_ids = [0] * self.max_loras
        self.slot_of: dict[int, int] = {}
        self.slot_last_step = [0] * self.max_loras
        self.num_steps = 0
        self.in_use: Callable[[], set[int]] = set  # the engine core's unfinished requests' adapters

    @property
    def slot_bytes(self) -> int:
        return sum(w.a.numel() * w.a.element_size() + w.b.numel() * w.b.element_size() for w in self.layers.values())

    # --- adapters in memory (between steps) --------------------------------------------------
    def add(self, request: LoRARequest) -> LoadedAdapter:
        """Make the adapter available (read and checked now unless it is in memory already);
        raises InvalidRequestError naming the file and field. Rank 0 tells the other ranks."""
        held = self.adapters.get(request.lora_int_id)
        if held is not None:
            if (held.request.lora_path, held.request.lora_name) != (request.lora_path, request.lora_name):
                raise InvalidRequestError(
                    f"lora_int_id: {request.lora_int_id} is already the id of adapter {held.request.lora_name!r} "
                    f"({held.request.lora_path}); each adapter needs its own id")
            self.adapters.move_to_end(request.lora_int_id)
            self.removed.discard(request.lora_int_id)
            return held
        adapter = load_adapter(request, self.targets, self.max_lora_rank, self.dtype)
        self._send(_ADD, request)
        self.adapters[request.lora_int_id] = adapter
        self.removed.discard(request.lora_int_id)
        logger.info("LoRA adapter %r (id %d, rank %d, %.1f MiB) read from %s", request.lora_name,
                    request.lora_int_id, adapter.rank, adapter.nbytes / 2**20, request.lora_path)
        self.trim(keep=request.lora_int_id)  # its request is not queued yet: not "in use"
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (now, or when the last unfinished request that uses it ends) and empty
        its slot; False if it is not held."""
        if lora_int_id not in self.adapters:
            return False
        self.removed.add(lora_int_id)
        self.trim()
        return True

    def list(self) -> list[LoRARequest]:
        return [a.request for a in self.adapters.values() if a.request.lora_int_id not in self.removed]

    def trim(self, keep: int = 0) -> None:
        """Drop the removed adapters no unfinished request uses, then the least recently used
        ones past the capacity (never one in use, nor ``keep``)."""
        in_use = self.in_use() if (self.removed or len(self.adapters) > self.capacity) else set()
        in_use.add(keep)
        for lora_id in [i for i in self.removed if i not in in_use]:
            self._drop(lora_id, empty_slot=True)
        excess = len(self.adapters) - self.capacity
        for lora_id in list(self.adapters):
            if excess <= 0:
                break
            if lora_id not in in_use:
                self._drop(lora_id, empty_slot=False)
                excess -= 1

    def _drop(self, lora_id: int, empty_slot: bool) -> None:
        self.adapters.pop(lora_id, None)
        self.removed.discard(lora_id)
        self._send(_REMOVE, None, lora_id)
        if empty_slot and lora_id in self.slot_of:  # an id used again later may name other weights
            self.slot_ids[self.slot_of.pop(lora_id)] = 0

    # --- tensor parallelism -------------------------------------------------------------------
    def _send(self, op: int, request: LoRARequest | None, lora_id: int = 0) -> None:
        if self.tp is None or self.tp.size == 1 or not self.tp.is_first:
            return
        self.tp.broadcast_array(control_message(op, request, lora_id))

    def handle_control(self, packed: np.ndarray) -> None:
        """A control message from rank 0 (the other ranks)."""
        op, lora_id = int(packed[1]), int(packed[2])
        if op == _ADD:
            name_len = int(packed[3])
            data = bytes(packed[4:].astype(np.uint8))
            request = LoRARequest(data[:name_len].decode(), lora_id, data[name_len:].decode())
            self.adapters[lora_id] = load_adapter(request, self.targets, self.max_lora_rank, self.dtype)
        elif op == _REMOVE:
            self.adapters.pop(lora_id, None)
            if lora_id in self.slot_of and lora_id not in self.adapters:
                self.slot_ids[self.slot_of.pop(lora_id)] = 0

    # --- the step -----------------------------------------------------------------------------
    def prepare_step(self, lora_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Rank 0: each scheduled request's slot (-1: none), in order, and the slot loads
        ``[[slot, id], ...]`` this step needs (``begin_step`` applies them)."""
        self.num_steps += 1
        step = self.num_steps
        needed = set(lora_ids)
        needed.discard(0)
        if len(needed) > self.max_loras:  # the scheduler's admission keeps this from happening
            raise RuntimeError(f"a step with {len(needed)} adapters; lora.max_loras is {self.max_loras}")
        loads = []
        for lora_id in needed:
            if lora_id in self.slot_of:
                continue
            if lora_id not in self.adapters:
                raise RuntimeError(f"LoRA adapter id {lora_id} is scheduled but not held")
            slot = min((s for s in range(self.max_loras) if self.slot_ids[s] not in needed),
                       key=lambda s: (self.slot_ids[s] != 0, self.slot_last_step[s]))
            old = self.slot_ids[slot]
            if old:
                del self.slot_of[old]
            self.slot_ids[slot] = lora_id
            self.slot_of[lora_id] = slot
            loads.append((slot, lora_id))
        slot_of = self.slot_of
        slots = np.array([slot_of[i] if i else -1 for i in lora_ids], dtype=np.int32)
        for lora_id in needed:
            self.slot_last_step[slot_of[lora_id]] = step
        return slots, np.array(loads, dtype=np.int64).reshape(-1, 2)

    def begin_step(self, token_slots: np.ndarray | None, loads: np.ndarray) -> None:
        """Every rank: copy the loaded adapters into their slots, then publish the rows' slots."""
        for slot, lora_id in loads.tolist():
            self._write_slot(slot, self.adapters[lora_id])
            if self.tp is not None and not self.tp.is_first:  # rank 0 tracked it in prepare_step
                old = self.slot_ids[slot]
                if old:
                    self.slot_of.pop(old, None)
                self.slot_ids[slot], self.slot_of[lora_id] = lora_id, slot
        batch = self.batch
        batch.step += 1
        if token_slots is None:
            batch.token_slots = None
            return
        batch.slots = sorted({int(s) for s in np.unique(token_slots) if s >= 0})
        batch.rows_by_slot = [torch.from_numpy(np.flatnonzero(token_slots == s)).to(self.device) for s in batch.slots]
        batch.token_slots = torch.from_numpy(np.ascontiguousarray(token_slots, dtype=np.int32)).to(self.device)

    def end_step(self) -> None:
        self.batch.token_slots = None

    def _write_slot(self, slot: int, adapter: LoadedAdapter) -> None:
        step = self.max_lora_rank
        for name, weights in self.layers.items():
            weights.a[slot].zero_()
            weights.b[slot].zero_()
            rank = 0
            for part, a, b, out_start in adapter.layers.get(name, ()):
                r = a.shape[0]
                weights.a[slot, part * step: part * step + r].copy_(a)
                weights.b[slot, part * step: part * step + r, out_start: out_start + b.shape[1]].copy_(b)
                rank = max(rank, r)
            weights.ranks[slot] = rank


def control_message(op: int, request: LoRARequest | None, lora_id: int = 0) -> np.ndarray:
    """``[CONTROL, op, id, len(name), name and path as UTF-8 bytes]`` (one int64 each)."""
    if request is None:
        return np.array([CONTROL, op, lora_id, 0], dtype=np.int64)
    name = request.lora_name.encode()
    data = np.frombuffer(name + request.lora_path.encode(), dtype=np.uint8).astype(np.int64)
    return np.concatenate([np.array([CONTROL, op, request.lora_int_id, len(name)], dtype=np.int64), data])
