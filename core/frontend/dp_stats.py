"""One engine's stats from the ``stats`` utility results of its data-parallel cores.

Each core reports its ``CoreStats`` fields plus ``num_blocks``, ``num_free_blocks``, ``pid`` and
``num_requests_added``. The combination, field by field:

- ``kv_usage``: over all blocks of all cores, ``1 - sum(num_free_blocks) / sum(num_blocks)``
  (not the mean of the cores' fractions, which would misweigh cores of different sizes);
- ``peak_kv_usage``: the highest of the cores' peaks (peaks at different times do not add up);
- ``pid``: the first core's (rank 0), and ``pids``: every core's, in rank order;
- every other number: the sum (requests running and waiting, blocks, steps, preemptions,
  prefix-cache queries and hits, requests added);
- any other value: kept if every core reports the same, else the list of the cores' values.

With one core the result is that core's dict plus ``pids``.
"""

from __future__ import annotations

from typing import Any, Sequence

_MAX = frozenset({"peak_kv_usage"})


def combine_core_stats(per_core: Sequence[dict[str, Any]]) -> dict[str, Any]:
    if not per_core:
        raise ValueError("no core stats to combine")
    if len(per_core) == 1:
        return {**per_core[0], "pids": [per_core[0].get("pid")]}
    out: dict[str, Any] = {}
    keys = list(dict.fromkeys(k for stats in per_core for k in stats))
    for key in keys:
        values = [stats.get(key) for stats in per_core]
        if key == "pid":
            out["pid"] = values[0]
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = max(values) if key in _MAX else sum(values)
        elif all(v == values[0] for v in values):
            out[key] = values[0]
        else:
            out[key] = values
    out["pids"] = [stats.get("pid") for stats in per_core]
    blocks, free = out.get("num_blocks"), out.get("num_free_blocks")
    if isinstance(blocks, (int, float)) and isinstance(free, (int, float)) and blocks > 0:
        out["kv_usage"] = 1.0 - free / blocks
    return out
