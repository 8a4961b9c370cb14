"""Paged attention through FlashInfer (``flashinfer-python``, an optional extra: imported only when
the backend is constructed, never by the plugin that registers it).

FlashInfer reads a paged KV cache described in CSR form, per request ``b``:

- ``kv_indptr[b] : kv_indptr[b + 1]`` is the range of ``kv_indices`` holding its pages (our block
  ids, in order);
- ``kv_last_page_len[b]`` in ``[1, page_size]`` is how many tokens of its last page are used, so
  its KV length is ``(pages - 1) * page_size + last_page_len`` (= our ``seq_len``);
- for prefill/append, ``qo_indptr`` is the cumulative query length (our ``query_start_loc``
  restricted to the prefill requests and rebased to 0).

Our cache is exactly FlashInfer's "NHD" layout given as a ``(k_cache, v_cache)`` tuple of
``[num_pages, page_size, num_kv_heads, head_dim]`` tensors, so nothing is copied.

Per step, ``build_metadata`` computes these arrays (decode part: requests ``[0, num_decodes)``;
prefill part: the rest) and calls ``plan`` once on a ``BatchDecodeWithPagedKVCacheWrapper`` and a
``BatchPrefillWithPagedKVCacheWrapper`` (``causal=True``: FlashInfer aligns the causal mask
bottom-right when the query is shorter than the KV, i.e. full attention over the cached prefix).
Each layer's ``forward`` writes the new K/V at ``slot_mapping`` (``index_copy_``, like the torch
backend) and calls ``run`` on each wrapper for its slice of the queries.

The CSR arithmetic is plain tensor code (``decode_plan_arrays``, ``prefill_plan_arrays``,
``gather_kv_indices``), tested on the CPU; the ``plan``/``run`` calls need a CUDA GPU.
API used (docs.flashinfer.ai, "flashinfer.decode" / "flashinfer.prefill";
flashinfer/decode.py and flashinfer/prefill.py of flashinfer-ai/flashinfer):

- ``BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=...)``;
  ``.plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
  q_data_type=, kv_data_type=, sm_scale=)``; ``.run(q, (k_cache, v_cache), out=)``
- ``BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")``; ``.plan(qo_indptr, paged_kv_indptr,
  paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
  causal=True, sm_scale=, q_data_type=, kv_data_type=)``; ``.run(q, (k_cache, v_cache), out=)``
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from paged.core.attention import AttentionLayout, BatchInputs, default_allocate_kv_cache, write_kv_by_slot

INSTALL_HINT = "flashinfer-python is not installed: pip install 'paged[flashinfer]'"


def is_available(device: str) -> tuple[bool, str]:
    """Cheap (no import of flashinfer) and never raises."""
    if device != "cuda":
        return False, f"needs a CUDA GPU (device is {device})"
    try:
        if importlib.util.find_spec("flashinfer") is None:
            return False, INSTALL_HINT
    except (ImportError, ValueError):
        return False, INSTALL_HINT
    return True, ""


class FlashInferOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    workspace_mib: int = Field(128, ge=16, description="FlashInfer float workspace, MiB (shared by both wrappers)")
    decode_tensor_cores: bool | None = Field(
        None, description="decode through the tensor-core (prefill) kernels; None = when num_heads/num_kv_heads > 4"
    )


# ---- the CSR arrays (pure, CPU) ---------------------------------------------------------------


@dataclass
class PagedKVArrays:
    """FlashInfer's paged-KV description of a range of requests (CPU tensors).

    ``kv_page_pos`` holds flat positions into the step's block table (``row * width + column``),
    so that the page ids themselves are gathered on the block table's device without a sync
    (``gather_kv_indices``)."""

    kv_indptr: torch.Tensor  # [n + 1] int32
    kv_page_pos: torch.Tensor  # [kv_indptr[-1]] int64
    kv_last_page_len: torch.Tensor  # [n] int32, in [1, page_size]
    qo_indptr: torch.Tensor | None = None  # [n + 1] int32 (prefill only)

    @property
    def num_reqs(self) -> int:
        return len(self.kv_last_page_len)


def paged_kv_arrays(seq_lens, rows, page_size: int, table_width: int) -> PagedKVArrays:
    """CSR arrays of requests ``rows`` (block-table rows) with ``seq_lens`` tokens in context."""
    seq = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    assert len(seq) == len(rows) and (seq > 0).all(), "every request has at least one token in context"
    pages = (seq + page_size - 1) // page_size
    assert (pages <= table_width).all(), "block table narrower than a request's context"
    indptr = np.zeros(len(seq) + 1, dtype=np.int64)
    np.cumsum(pages, out=indptr[1:])
    # column c of row r for c < pages[r]: flat index r * width + c
    cols = np.arange(int(indptr[-1]), dtype=np.int64) - np.repeat(indptr[:-1], pages)
    pos = np.repeat(rows, pages) * table_width + cols
    last = seq - (pages - 1) * page_size
    return PagedKVArrays(
        kv_indptr=torch.from_numpy(indptr.astype(np.int32)),
        kv_page_pos=torch.from_numpy(pos),
        kv_last_page_len=torch.from_numpy(last.astype(np.int32)),
    )


def decode_plan_arrays(batch: BatchInputs, page_size: int) -> PagedKVArrays | None:
    """The decodes: requests ``[0, num_decodes)``; None when there are none."""
    nd = batch.num_decodes
    if nd == 0:
        return None
    return paged_kv_arrays(batch.seq_lens_cpu[:nd].numpy(), np.arange(nd), page_size, batch.block_table.shape[1])


def prefill_plan_arrays(batch: BatchInputs, page_size: int) -> PagedKVArrays | None:
    """The prefill chunks: requests ``[num_decodes, num_reqs)``, with ``qo_indptr`` rebased so that
    it indexes the prefill queries ``query[query_start_loc[num_decodes]:]``; None when none."""
    nd, nr = batch.num_decodes, batch.num_reqs
    if nr == nd:
        return None
    arrays = paged_kv_arrays(batch.seq_lens_cpu[nd:nr].numpy(), np.arange(nd, nr), page_size, batch.block_table.shape[1])
    qsl = batch.query_start_loc_cpu[nd : nr + 1].to(torch.int64)
    arrays.qo_indptr = (qsl - qsl[0]).to(torch.int32)
    return arrays


def gather_kv_indices(block_table: torch.Tensor, arrays: PagedKVArrays) -> torch.Tensor:
    """The page ids (int32, on the block table's device) that ``arrays.kv_page_pos`` points at."""
    pos = arrays.kv_page_pos.to(block_table.device, non_blocking=True)
    return block_table.reshape(-1).index_select(0, pos).to(torch.int32)


# ---- the backend ------------------------------------------------------------------------------


@dataclass
class FlashInferMetadata:
    num_tokens: int
    num_decode_tokens: int  # = num_decodes: the first queries go to the decode wrapper
    slot_mapping: torch.Tensor  # [num_tokens] int64
    decode: PagedKVArrays | None
    prefill: PagedKVArrays | None


class FlashInferAttentionBackend:
    name = "flashinfer"

    def __init__(self, layout: AttentionLayout, options: FlashInferOptions | None = None) -> None:
        device = torch.device(layout.device)
        if device.type != "cuda":
            raise RuntimeError(f"flashinfer attention needs a CUDA GPU (device is {device.type})")
        if layout.num_heads % layout.num_kv_heads:
            raise ValueError(f"num_heads {layout.num_heads} is not a multiple of num_kv_heads {layout.num_kv_heads}")
        if layout.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"flashinfer attention runs in float16 or bfloat16, not {layout.dtype}: "
                "set --dtype bfloat16 (or float16), or use another attention backend"
            )
        try:
            import flashinfer
        except ImportError as e:
            raise RuntimeError(f"{INSTALL_HINT} ({e})") from None
        self.layout = layout
        self.options = options or FlashInferOptions()
        group = layout.num_heads // layout.num_kv_heads
        tensor_cores = self.options.decode_tensor_cores
        if tensor_cores is None:
            tensor_cores = group > 4
        self._workspace = torch.zeros(self.options.workspace_mib * 2**20, dtype=torch.uint8, device=device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=tensor_cores
        )
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")

    def allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return default_allocate_kv_cache(self.layout, num_blocks)

    def build_metadata(self, batch: BatchInputs) -> FlashInferMetadata:
        layout = self.layout
        page = layout.block_size
        decode = decode_plan_arrays(batch, page)
        prefill = prefill_plan_arrays(batch, page)
        common = (layout.num_heads, layout.num_kv_heads, layout.head_dim, page)
        if decode is not None:
            self._decode.plan(
                decode.kv_indptr, gather_kv_indices(batch.block_table, decode), decode.kv_last_page_len, *common,
                q_data_type=layout.dtype, kv_data_type=layout.dtype, sm_scale=layout.scale,
            )
        if prefill is not None:
            self._prefill.plan(
                prefill.qo_indptr, prefill.kv_indptr, gather_kv_indices(batch.block_table, prefill),
                prefill.kv_last_page_len, *common,
                causal=True, sm_scale=layout.scale, q_data_type=layout.dtype, kv_data_type=layout.dtype,
            )
        return FlashInferMetadata(
            num_tokens=batch.num_tokens,
            num_decode_tokens=batch.num_decodes,
            slot_mapping=batch.slot_mapping.long(),
            decode=decode,
            prefill=prefill,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: FlashInferMetadata,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        write_kv_by_slot(key, value, kv_cache, metadata.slot_mapping)
        q = query.to(k_cache.dtype)
        out = torch.empty(q.shape, dtype=k_cache.dtype, device=q.device)
        nd = metadata.num_decode_tokens
        if metadata.decode is not None:
            self._decode.run(q[:nd].contiguous(), (k_cache, v_cache), out=out[:nd])
        if metadata.prefill is not None:
            self._prefill.run(q[nd:].contiguous(), (k_cache, v_cache), out=out[nd:])
        return out if out.dtype == query.dtype else out.to(query.dtype)

