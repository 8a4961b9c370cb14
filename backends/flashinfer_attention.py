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

Per step and distinct layer setting (``AttentionSettings``: most models have one, Gemma-style
local/global models two), the first layer of the step with that setting computes these arrays
(decode part: requests ``[0, num_decodes)``; prefill part: the rest) and calls ``plan`` once on
that setting's ``BatchDecodeWithPagedKVCacheWrapper`` and ``BatchPrefillWithPagedKVCacheWrapper``
(``causal=True``: FlashInfer aligns the causal mask bottom-right when the query is shorter than
the KV, i.e. full attention over the cached prefix); the plan carries the layer's ``sm_scale``,
``window_left`` (FlashInfer's window excludes the query's own position: ``sliding_window - 1``)
and ``logits_soft_cap`` (``plan_options``). Each setting has its own wrappers and workspace (a
wrapper keeps its plan in its workspace). With a window, each request's page list leaves out the
leading pages no query of the step can see (``skip_pages``): the KV manager may have freed them,
and FlashInfer, like every backend, must not read them; dropping whole leading pages keeps the
bottom-right alignment exact. Each layer's ``forward`` writes the new K/V at ``slot_mapping``
(``index_copy_``, like the torch backend) and calls ``run`` on each wrapper for its slice of the
queries.

The CSR arithmetic is plain tensor code (``decode_plan_arrays``, ``prefill_plan_arrays``,
``gather_kv_indices``), tested on the CPU; the ``plan``/``run`` calls need a CUDA GPU.
API used (docs.flashinfer.ai, "flashinfer.decode" / "flashinfer.prefill";
flashinfer/decode.py and flashinfer/prefill.py of flashinfer-ai/flashinfer):

- ``BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=...)``;
  ``.plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
  q_data_type=, kv_data_type=, sm_scale=, window_left=, logits_soft_cap=)``;
  ``.run(q, (k_cache, v_cache), out=)``
- ``BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")``; ``.plan(qo_indptr, paged_kv_indptr,
  paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
  causal=True, sm_scale=, window_left=, logits_soft_cap=, q_data_type=, kv_data_type=)``;
  ``.run(q, (k_cache, v_cache), out=)``
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from paged.core.attention import (
    DEFAULT_SETTINGS,
    FEATURES,
    AttentionLayout,
    AttentionSettings,
    BatchInputs,
    default_allocate_kv_cache,
    write_kv_by_slot,
)

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


def paged_kv_arrays(seq_lens, rows, page_size: int, table_width: int, skip_pages=None) -> PagedKVArrays:
    """CSR arrays of requests ``rows`` (block-table rows) with ``seq_lens`` tokens in context;
    ``skip_pages`` (per request, optional): leading pages left out (the request's KV then starts
    at position ``skip * page_size``)."""
    seq = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    assert len(seq) == len(rows) and (seq > 0).all(), "every request has at least one token in context"
    total = (seq + page_size - 1) // page_size
    assert (total <= table_width).all(), "block table narrower than a request's context"
    skip = np.zeros_like(seq) if skip_pages is None else np.asarray(skip_pages, dtype=np.int64).reshape(-1)
    assert ((skip >= 0) & (skip < total)).all(), "a request keeps at least its last page"
    pages = total - skip
    indptr = np.zeros(len(seq) + 1, dtype=np.int64)
    np.cumsum(pages, out=indptr[1:])
    # column skip[r] + c of row r for c < pages[r]: flat index r * width + skip[r] + c
    cols = np.arange(int(indptr[-1]), dtype=np.int64) - np.repeat(indptr[:-1], pages) + np.repeat(skip, pages)
    pos = np.repeat(rows, pages) * table_width + cols
    last = seq - (total - 1) * page_size
    return PagedKVArrays(
        kv_indptr=torch.from_numpy(indptr.astype(np.int32)),
        kv_page_pos=torch.from_numpy(pos),
        kv_last_page_len=torch.from_numpy(last.astype(np.int32)),
    )


def skip_pages(seq_lens: np.ndarray, query_lens: np.ndarray, page_size: int, window: int | None) -> np.ndarray | None:
    """Leading pages of each request that no query of the step sees: its first query, at position
    ``seq_len - q_len``, sees keys from ``first - window + 1`` on. None without a window."""
    if window is None:
        return None
    return np.maximum(seq_lens - query_lens - window + 1, 0) // page_size


def decode_plan_arrays(batch: BatchInputs, page_size: int, window: int | None = None) -> PagedKVArrays | None:
    """The decodes: requests ``[0, num_decodes)``; None when there are none."""
    nd = batch.num_decodes
    if nd == 0:
        return None
    seq = batch.seq_lens_cpu[:nd].numpy().astype(np.int64)
    return paged_kv_arrays(seq, np.arange(nd), page_size, batch.block_table.shape[1],
                           skip_pages(seq, np.ones_like(seq), page_size, window))


def prefill_plan_arrays(batch: BatchInputs, page_size: int, window: int | None = None) -> PagedKVArrays | None:
    """The prefill chunks: requests ``[num_decodes, num_reqs)``, with ``qo_indptr`` rebased so that
    it indexes the prefill queries ``query[query_start_loc[num_decodes]:]``; None when none."""
    nd, nr = batch.num_decodes, batch.num_reqs
    if nr == nd:
        return None
    seq = batch.seq_lens_cpu[nd:nr].numpy().astype(np.int64)
    qsl = batch.query_start_loc_cpu[nd : nr + 1].to(torch.int64)
    q_lens = (qsl[1:] - qsl[:-1]).numpy()
    arrays = paged_kv_arrays(seq, np.arange(nd, nr), page_size, batch.block_table.shape[1],
                             skip_pages(seq, q_lens, page_size, window))
    arrays.qo_indptr = (qsl - qsl[0]).to(torch.int32)
    return arrays


def plan_options(layout: AttentionLayout, settings: AttentionSettings) -> dict[str, Any]:
    """The ``plan`` keywords of a layer's settings: ``sm_scale``; ``window_left`` (FlashInfer's
    window counts the keys left of the query, ours includes the query: ``W - 1``; -1 = none);
    ``logits_soft_cap`` (None = none)."""
    window = settings.sliding_window
    return {
        "sm_scale": settings.softmax_scale(layout.head_dim),
        "window_left": -1 if window is None else window - 1,
        "logits_soft_cap": settings.logits_soft_cap,
    }


def plan_step(layout: AttentionLayout, batch: BatchInputs, settings: AttentionSettings, decode_wrapper,
              prefill_wrapper) -> tuple[PagedKVArrays | None, PagedKVArrays | None]:
    """Plan one step's decode and prefill parts on the two wrappers for layers with ``settings``;
    returns their arrays (None for an empty part)."""
    page = layout.block_size
    decode = decode_plan_arrays(batch, page, settings.sliding_window)
    prefill = prefill_plan_arrays(batch, page, settings.sliding_window)
    common = (layout.num_heads, layout.num_kv_heads, layout.head_dim, page)
    options = plan_options(layout, settings)
    if decode is not None:
        decode_wrapper.plan(
            decode.kv_indptr, gather_kv_indices(batch.block_table, decode), decode.kv_last_page_len, *common,
            q_data_type=layout.dtype, kv_data_type=layout.dtype, **options,
        )
    if prefill is not None:
        prefill_wrapper.plan(
            prefill.qo_indptr, prefill.kv_indptr, gather_kv_indices(batch.block_table, prefill),
            prefill.kv_last_page_len, *common,
            causal=True, q_data_type=layout.dtype, kv_data_type=layout.dtype, **options,
        )
    return decode, prefill


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
    batch: BatchInputs  # what each setting's plan is made from, on the first layer that needs it
    # per layer setting: (decode arrays, prefill arrays), planned on that setting's wrappers this step
    planned: dict[AttentionSettings, tuple[PagedKVArrays | None, PagedKVArrays | None]] = field(default_factory=dict)


class FlashInferAttentionBackend:
    name = "flashinfer"
    layer_features = FEATURES  # sliding window (window_left), logit soft-cap, per-layer scale

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
        self._flashinfer = flashinfer
        self._tensor_cores = tensor_cores
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=tensor_cores
        )
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        # each distinct layer setting plans its own wrappers (a plan lives in its workspace)
        self._wrappers: dict[AttentionSettings, tuple[Any, Any]] = {DEFAULT_SETTINGS: (self._decode, self._prefill)}

    def _wrappers_for(self, settings: AttentionSettings) -> tuple[Any, Any]:
        wrappers = self._wrappers.get(settings)
        if wrappers is None:  # a second setting (a local/global model): its own workspace
            workspace = torch.zeros_like(self._workspace)
            wrappers = self._wrappers[settings] = (
                self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    workspace, "NHD", use_tensor_cores=self._tensor_cores),
                self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD"),
            )
        return wrappers

    def allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return default_allocate_kv_cache(self.layout, num_blocks)

    def build_metadata(self, batch: BatchInputs) -> FlashInferMetadata:
        """The step's arrays; each layer setting is planned by its first layer (``forward``)."""
        return FlashInferMetadata(
            num_tokens=batch.num_tokens,
            num_decode_tokens=batch.num_decodes,
            slot_mapping=batch.slot_mapping.long(),
            batch=batch,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: FlashInferMetadata,
        settings: AttentionSettings = DEFAULT_SETTINGS,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        decode_wrapper, prefill_wrapper = self._wrappers_for(settings)
        planned = metadata.planned.get(settings)
        if planned is None:  # the step's first layer with this setting
            planned = metadata.planned[settings] = plan_step(
                self.layout, metadata.batch, settings, decode_wrapper, prefill_wrapper)
        decode, prefill = planned
        write_kv_by_slot(key, value, kv_cache, metadata.slot_mapping)
        q = query.to(k_cache.dtype)
        out = torch.empty(q.shape, dtype=k_cache.dtype, device=q.device)
        nd = metadata.num_decode_tokens
        if decode is not None:
            decode_wrapper.run(q[:nd].contiguous(), (k_cache, v_cache), out=out[:nd])
        if prefill is not None:
            prefill_wrapper.run(q[nd:].contiguous(), (k_cache, v_cache), out=out[nd:])
        return out if out.dtype == query.dtype else out.to(query.dtype)

