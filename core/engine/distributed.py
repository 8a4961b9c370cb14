"""Tensor parallelism on torch.distributed: the process group, the collectives the model layers
use, and the partition of heads, MLP columns and vocabulary over ranks.

One group holds every rank (``world_size == tensor_parallel_size``); the model's parallel
layers read it through ``get_tp()`` when they are built, so a model plugin's constructor keeps
its signature. With one rank (the default) nothing here touches torch.distributed and every
collective is a no-op.

Ranks join through torch.distributed's TCP rendezvous at ``MASTER_ADDR:MASTER_PORT`` with their
``RANK`` of ``WORLD_SIZE`` (what ``torchrun`` sets; the executor sets the same for ranks it starts
itself), so ranks may live on several machines. Collectives use NCCL on GPUs and gloo on CPUs; the per-step broadcast of the
scheduler's decisions (small integer arrays) always goes over a gloo group, as it lives on the CPU.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from paged.core.engine.torchrun_env import rendezvous_from_env  # noqa: F401 (its old home)
from paged.core.errors import ConfigError


@dataclass
class TensorParallel:
    """This process's place in the tensor-parallel group. ``group`` carries the model's
    collectives (NCCL or gloo), ``cpu_group`` the step broadcast (gloo)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over ranks (``x`` itself when alone; else possibly a new tensor)."""
        if self.size == 1:
            return x
        if x.is_cuda:
            dist.all_reduce(x, group=self.group)
            return x
        return self._exchange_and_sum(x)

    def _exchange_and_sum(self, x: torch.Tensor) -> torch.Tensor:
        """All-reduce by direct exchange: every rank sends ``x`` to every other and adds up all
        of them in rank order, so every rank gets the same bits. For the few ranks and small
        activations of CPU tensor parallelism, gloo's point-to-point messages take a fraction of
        the time of its all_reduce (measured on a 2-core machine over loopback: 0.2-0.3 ms vs
        1.1-1.7 ms for a decode step's [1..32, 576] activations)."""
        x = x.contiguous()
        parts = [x if r == self.rank else torch.empty_like(x) for r in range(self.size)]
        ops = [dist.P2POp(dist.isend, x, r, self.group) for r in range(self.size) if r != self.rank]
        ops += [dist.P2POp(dist.irecv, parts[r], r, self.group) for r in range(self.size) if r != self.rank]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        total = parts[0] + parts[1]
        for part in parts[2:]:
            total += part
        return total

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` (same shape on every rank) along the last dimension,
        on rank 0; the other ranks get None."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None


    def broadcast_array(self, array: np.ndarray | None) -> np.ndarray | None:
        """Rank 0 sends a 1-D int64 array, or None (the stop sentinel); every other rank passes
        None and receives it. Two gloo broadcasts: the length, then the data."""
        length = torch.tensor([-1 if array is None else len(array)], dtype=torch.int64)
        dist.broadcast(length, src=0, group=self.cpu_group)
        n = int(length.item())
        if n < 0:
            return None
        data = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)) if self.rank == 0 else torch.empty(n, dtype=torch.int64)
        dist.broadcast(data, src=0, group=self.cpu_group)
        return data.numpy()


_tp = TensorParallel()


def get_tp() -> TensorParallel:
    return _tp


# Ranks other than 0 wait in a broadcast for as long as the server is idle: the group's timeout
# must outlast any idle spell. A rank that dies is noticed by its peers' closed connections.
_GROUP_TIMEOUT = datetime.timedelta(days=3650)
STORE_TIMEOUT = datetime.timedelta(seconds=600)  # how long the ranks of a group wait for each other to join


def init_tensor_parallel(rank: int, size: int, device: torch.device, master_addr: str, master_port: int,
                         own_store: bool = False) -> TensorParallel:
    """Join the rendezvous at ``master_addr:master_port`` as ``rank`` of ``size`` and make the
    group current for the layers built afterwards. ``own_store``: rank 0 hosts the rendezvous
    store itself even under torchrun (a data-parallel group's own rendezvous, not the agent's)."""
    global _tp
    backend = "nccl" if device.type == "cuda" else "gloo"
    if own_store:
        store = dist.TCPStore(master_addr, master_port, size, is_master=rank == 0, timeout=STORE_TIMEOUT)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=_GROUP_TIMEOUT)
    else:
        dist.init_process_group(
            backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=size, timeout=_GROUP_TIMEOUT
        )
    cpu_group = dist.new_group(backend="gloo", timeout=_GROUP_TIMEOUT) if backend != "gloo" else dist.group.WORLD
    _tp = TensorParallel(rank, size, dist.group.WORLD, cpu_group)
    return _tp


def destroy_tensor_parallel() -> None:
    global _tp
    if _tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _tp = TensorParallel()


# ---- how the model is split ------------------------------------------------------------------


def shard_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """``[start, end)`` of ``rank``'s share of ``total`` items, as even as possible (the first
    ``total % size`` ranks hold one more)."""
    base, extra = divmod(total, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank computes: query heads ``[q_start, q_end)`` and the KV heads
    ``[kv_start, kv_end)`` they read. Every query head of a GQA group stays with its KV head."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int

    @property
    def num_heads(self) -> int:
        return self.q_end - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_end - self.kv_start


def shard_heads(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadShard:
    """Split the KV heads over the ranks (with their query groups); when there are fewer KV heads
    than ranks, each KV head is replicated on ``size / num_kv_heads`` ranks (rounded) and its
    group's query heads are split between them."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        kv_start, kv_end = shard_range(num_kv_heads, rank, size)
        return HeadShard(kv_start * group, kv_end * group, kv_start, kv_end)
    kv = rank * num_kv_heads // size
    sharing = [r for r in range(size) if r * num_kv_heads // size == kv]
    q_start, q_end = shard_range(group, sharing.index(rank), len(sharing))
    if q_start == q_end:
        raise ConfigError(
            f"parallel.tensor_parallel_size: {size} ranks cannot share {num_heads} query heads in "
            f"{num_kv_heads} KV groups (a rank would get no query head); use at most "
            f"{num_heads} ranks, or a size that {num_kv_heads} KV heads divide into groups of <= {group}"
        )
    return HeadShard(kv * group + q_start, kv * group + q_end, kv, kv + 1)
