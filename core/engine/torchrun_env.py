"""What torchrun's environment says about this process, read without torch.

The CLI asks this before anything else (is this process a tensor-parallel worker, a headless
node?), and the API server's front-end does not otherwise import torch: only the engine core
and its ranks do. ``paged.core.engine.distributed`` and ``paged.core.engine.tp_ranks`` re-export
both functions under their old homes.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from paged.core.errors import ConfigError

if TYPE_CHECKING:
    from paged.core.config import EngineConfig


def rendezvous_from_env() -> tuple[int, int] | None:
    """``(rank, world_size)`` when this process was started by torchrun (or by hand with the same
    variables) as part of a group of more than one; else None."""
    world = os.environ.get("WORLD_SIZE")
    if world is None or int(world) <= 1:
        return None
    return int(os.environ.get("RANK", "0")), int(world)


def torchrun_placement(config: EngineConfig) -> tuple[int, int] | None:
    """Under torchrun: (data-parallel rank, rank in its tensor-parallel group) of this process;
    None without torchrun. ConfigError when WORLD_SIZE is neither tensor_parallel_size nor
    data_parallel_size x tensor_parallel_size."""
    launched = rendezvous_from_env()
    if launched is None:
        return None
    rank, world = launched
    tp, dp = config.parallel.tensor_parallel_size, config.parallel.data_parallel_size
    if world != tp * dp:
        raise ConfigError(
            f"parallel.tensor_parallel_size: torchrun started WORLD_SIZE={world} processes, which must be "
            f"data_parallel_size x tensor_parallel_size ({dp} x {tp} = {dp * tp}); pass --tensor-parallel-size "
            f"{world // dp if world % dp == 0 else world} (with --data-parallel-size {dp if world % dp == 0 else 1})")
    return divmod(rank, tp)
