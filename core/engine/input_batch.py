"""The runner's persistent batch: one block-table row per request the runner holds, kept across
steps and changed only by what each step's ``SchedulerOutput`` says changed.

* A request admitted this step (the runner does not hold it) gets the next free row, written
  once with its full block list (prefix-cache hits included).
* A running request appends only the step's new block ids (mostly none) to its row.
* A finished or preempted request frees its row, and the last row moves into the hole, so the
  rows in use are always ``0 .. num_rows - 1``.

So a step's updates cost O(requests + new blocks), never O(blocks held). The step's own block
table is then one vectorised gather of the scheduled rows (``gather_block_table``), and its slot
mapping one vectorised lookup (``slot_mapping``).

Invariants (``r < num_rows``):
  ``row_of[req_ids[r]] == r``, and ``row_of`` holds nothing else;
  ``block_table[r, :num_blocks[r]]`` are the request's block ids in order;
  every other entry of ``block_table`` is 0 (the attention contract pads rows with 0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

if TYPE_CHECKING:
    from paged.core.engine.scheduler import ScheduledRequest


class InputBatch:
    def __init__(self, max_num_reqs: int, max_blocks_per_req: int) -> None:
        # Sized for the scheduler's limits (max_num_seqs, max_model_len); grows if ever asked
        # for more, rather than failing mid-step.
        self.block_table = np.zeros((max(1, max_num_reqs), max(1, max_blocks_per_req)), dtype=np.int32)
        self.num_blocks = np.zeros(max(1, max_num_reqs), dtype=np.int32)
        self.req_ids: list[str] = []  # row -> request id
        self.row_of: dict[str, int] = {}  # request id -> row

    @property
    def num_rows(self) -> int:
        return len(self.req_ids)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.row_of

    def block_ids(self, req_id: str) -> list[int]:
        """The request's block ids (a copy; for tests and debugging, not the step path)."""
        row = self.row_of[req_id]
        return self.block_table[row, : self.num_blocks[row]].tolist()

    # --- updates -----------------------------------------------------------------------
    def add(self, req_id: str, block_ids: Sequence[int]) -> int:
        """Give ``req_id`` (not held) the next row, holding ``block_ids``; returns the row."""
        if req_id in self.row_of:
            raise ValueError(f"request {req_id!r} already holds row {self.row_of[req_id]}")
        row = len(self.req_ids)
        if row == len(self.num_blocks):
            self._grow_rows(2 * row)
        n = len(block_ids)
        if n > self.block_table.shape[1]:
            self._grow_columns(n)
        self.block_table[row, :n] = block_ids
        self.num_blocks[row] = n
        self.req_ids.append(req_id)
        self.row_of[req_id] = row
        return row

    def append(self, req_id: str, new_block_ids: Sequence[int]) -> None:
        """Append ``new_block_ids`` to the row of ``req_id`` (held)."""
        if not new_block_ids:
            return
        row = self.row_of[req_id]
        start = int(self.num_blocks[row])
        end = start + len(new_block_ids)
        if end > self.block_table.shape[1]:
            self._grow_columns(end)
        self.block_table[row, start:end] = new_block_ids
        self.num_blocks[row] = end

    def remove(self, req_id: str) -> bool:
        """Free the row of ``req_id``; the last row moves into it. False if it was not held
        (e.g. a request that finished before it ever ran)."""
        row = self.row_of.pop(req_id, None)
        if row is None:
            return False
        last = len(self.req_ids) - 1
        n_removed = int(self.num_blocks[row])
        if row != last:
            n_last = int(self.num_blocks[last])
            self.block_table[row, :n_last] = self.block_table[last, :n_last]
            if n_removed > n_last:
                self.block_table[row, n_last:n_removed] = 0
            self.num_blocks[row] = n_last
            moved = self.req_ids[last]
            self.req_ids[row] = moved
            self.row_of[moved] = row
            n_removed = n_last  # what is left to clear, in the last row
        self.block_table[last, :n_removed] = 0
        self.num_blocks[last] = 0
        self.req_ids.pop()
        return True

    def update(self, removed: Iterable[str], scheduled: Iterable[ScheduledRequest]) -> None:
        """One step's changes: free the rows of ``removed`` (finished and preempted ids) first,
        so an id reused or re-admitted in the same step starts afresh; then for each
        ``ScheduledRequest`` append its new block ids, or, when it is not held (admitted this
        step: the scheduler sends the full list), add it."""
        for req_id in removed:
            self.remove(req_id)
        row_of = self.row_of
        for s in scheduled:
            req_id = s.request.request_id
            if req_id in row_of:
                if s.new_block_ids:
                    self.append(req_id, s.new_block_ids)
            else:
                self.add(req_id, s.new_block_ids)

    # --- reads for a step --------------------------------------------------------------
    def gather_block_table(self, rows: np.ndarray) -> np.ndarray:
        """``[len(rows), max_blocks]`` int32, C-contiguous: the block table of the given rows in
        that order, ``max_blocks`` the longest of them (at least 1), padded with 0."""
        max_blocks = max(1, int(self.num_blocks[rows].max())) if len(rows) else 1
        return self.block_table[rows, :max_blocks]

    def slot_mapping(self, token_rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
        """int64 slot of each token: token ``j`` of the request in row ``token_rows[i]``, at
        ``positions[i] = j``, lives in block ``block_table[row, j // block_size]`` at offset ``j %
        block_size``."""
        block_ids = self.block_table[token_rows, positions // block_size].astype(np.int64)
        return block_ids * block_size + positions % block_size

    # --- capacity ----------------------------------------------------------------------
    def _grow_rows(self, rows: int) -> None:
        table = np.zeros((rows, self.block_table.shape[1]), dtype=np.int32)
        table[: len(self.block_table)] = self.block_table
        counts = np.zeros(rows, dtype=np.int32)
        counts[: len(self.num_blocks)] = self.num_blocks
        self.block_table, self.num_blocks = table, counts

    def _grow_columns(self, columns: int) -> None:
        table = np.zeros((len(self.block_table), max(columns, 2 * self.block_table.shape[1])), dtype=np.int32)
        table[:, : self.block_table.shape[1]] = self.block_table
        self.block_table = table
