"""The FlashInfer backend's planning arithmetic (CPU, no flashinfer needed): the paged-KV CSR arrays
for the decode part and the prefill part of mixed batches, against arrays computed by hand; and
what selecting the backend on a machine without a CUDA GPU says."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from paged.backends import flashinfer_attention as fi
from paged.core.attention import AttentionLayout, BatchInputs


def make_batch(block_tables, computed_lens, query_lens, block_size, pad_cols=2) -> BatchInputs:
    """Decodes (query length 1 after a cached context) first, as the runner orders them."""
    num_reqs = len(block_tables)
    seq_lens = [c + q for c, q in zip(computed_lens, query_lens)]
    num_decodes = 0
    while num_decodes < num_reqs and query_lens[num_decodes] == 1 and computed_lens[num_decodes] > 0:
        num_decodes += 1
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    table = torch.zeros(num_reqs, max(len(b) for b in block_tables) + pad_cols, dtype=torch.int32)
    slots = []
    for i, blocks in enumerate(block_tables):
        assert len(blocks) == -(-seq_lens[i] // block_size)
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(computed_lens[i], seq_lens[i])]
    qsl_t = torch.from_numpy(qsl)
    seq_t = torch.tensor(seq_lens, dtype=torch.int32)
    return BatchInputs(
        num_reqs=num_reqs, num_tokens=int(qsl[-1]), num_decodes=num_decodes, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc=qsl_t.clone(), seq_lens=seq_t.clone(), block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_cpu=qsl_t, seq_lens_cpu=seq_t,
    )


def as_lists(arrays: fi.PagedKVArrays, block_table: torch.Tensor) -> dict:
    out = {
        "kv_indptr": arrays.kv_indptr.tolist(),
        "kv_indices": fi.gather_kv_indices(block_table, arrays).tolist(),
        "kv_last_page_len": arrays.kv_last_page_len.tolist(),
    }
    if arrays.qo_indptr is not None:
        out["qo_indptr"] = arrays.qo_indptr.tolist()
    for name in ("kv_indptr", "kv_last_page_len"):
        assert getattr(arrays, name).dtype == torch.int32 and getattr(arrays, name).device.type == "cpu"
    assert fi.gather_kv_indices(block_table, arrays).dtype == torch.int32
    return out


def test_mixed_batch_page_size_4():
    # page size 4. decodes: 5 cached + 1 -> 6 tokens in pages [7, 3] (2 used in the last);
    # 7 + 1 -> 8 in [1, 9] (last page full: 4, not 0); 1 + 1 -> 2 in [4].
    # prefills: 3 cached + 6 new -> 9 in [2, 8, 5] (last 1); 0 + 4 -> 4 in [6] (last 4);
    # 8 cached + 2 new -> 10 in [10, 11, 12] (last 2)
    tables = [[7, 3], [1, 9], [4], [2, 8, 5], [6], [10, 11, 12]]
    batch = make_batch(tables, [5, 7, 1, 3, 0, 8], [1, 1, 1, 6, 4, 2], block_size=4)
    assert batch.num_decodes == 3 and batch.block_table.shape == (6, 5)

    decode = fi.decode_plan_arrays(batch, 4)
    assert as_lists(decode, batch.block_table) == {
        "kv_indptr": [0, 2, 4, 5],
        "kv_indices": [7, 3, 1, 9, 4],
        "kv_last_page_len": [2, 4, 2],
    }
    assert decode.kv_page_pos.tolist() == [0, 1, 5, 6, 10]  # row * 5 + column

    prefill = fi.prefill_plan_arrays(batch, 4)
    assert as_lists(prefill, batch.block_table) == {
        "qo_indptr": [0, 6, 10, 12],  # the prefill queries start at token 3 of the step
        "kv_indptr": [0, 3, 4, 7],
        "kv_indices": [2, 8, 5, 6, 10, 11, 12],
        "kv_last_page_len": [1, 4, 2],
    }
    assert prefill.kv_page_pos.tolist() == [15, 16, 17, 20, 25, 26, 27]


def test_page_size_16_and_1():
    # page size 16: 16 tokens fill the page (last 16); 17 spill one token into a second page
    batch = make_batch([[3], [5, 2], [9, 4]], [15, 16, 0], [1, 1, 20], block_size=16)
    assert as_lists(fi.decode_plan_arrays(batch, 16), batch.block_table) == {
        "kv_indptr": [0, 1, 3],
        "kv_indices": [3, 5, 2],
        "kv_last_page_len": [16, 1],
    }
    assert as_lists(fi.prefill_plan_arrays(batch, 16), batch.block_table) == {
        "qo_indptr": [0, 20],
        "kv_indptr": [0, 2],
        "kv_indices": [9, 4],
        "kv_last_page_len": [4],
    }
    # page size 1: one page per token, the last always holds 1
    batch = make_batch([[4, 0, 2], [1, 3]], [2, 0], [1, 2], block_size=1)
    assert as_lists(fi.decode_plan_arrays(batch, 1), batch.block_table) == {
        "kv_indptr": [0, 3],
        "kv_indices": [4, 0, 2],
        "kv_last_page_len": [1],
    }
    assert as_lists(fi.prefill_plan_arrays(batch, 1), batch.block_table) == {
        "qo_indptr": [0, 2],
        "kv_indptr": [0, 2],
        "kv_indices": [1, 3],
        "kv_last_page_len": [1],
    }


def test_only_decodes_or_only_prefills():
    decodes = make_batch([[2, 6], [1]], [4, 2], [1, 1], block_size=4)
    assert fi.prefill_plan_arrays(decodes, 4) is None
    assert as_lists(fi.decode_plan_arrays(decodes, 4), decodes.block_table)["kv_indices"] == [2, 6, 1]
    prefills = make_batch([[2, 6], [1]], [0, 0], [8, 3], block_size=4)
    assert fi.decode_plan_arrays(prefills, 4) is None
    assert as_lists(fi.prefill_plan_arrays(prefills, 4), prefills.block_table) == {
        "qo_indptr": [0, 8, 11],
        "kv_indptr": [0, 2, 3],
        "kv_indices": [2, 6, 1],
        "kv_last_page_len": [4, 3],
    }


@pytest.mark.parametrize("seed", range(4))
def test_random_batches_reconstruct_the_context(seed):
    # invariants on random batches: each request's pages are its block-table prefix and
    # (pages - 1) * page_size + last_page_len == seq_len, last_page_len in [1, page_size]
    rng = np.random.default_rng(seed)
    page = int(rng.choice([1, 2, 8, 16]))
    n_dec, n_pre = int(rng.integers(0, 5)), int(rng.integers(0, 4))
    computed = [int(rng.integers(1, 60)) for _ in range(n_dec)] + [int(rng.integers(0, 40)) for _ in range(n_pre)]
    queries = [1] * n_dec + [int(rng.integers(2, 30)) for _ in range(n_pre)]
    if not computed:
        computed, queries = [0], [5]
    ids = iter(rng.permutation(1000).tolist())
    tables = [[next(ids) for _ in range(-(-(c + q) // page))] for c, q in zip(computed, queries)]
    batch = make_batch(tables, computed, queries, page)
    seq = batch.seq_lens_cpu.tolist()
    nd = batch.num_decodes
    for arrays, rows in ((fi.decode_plan_arrays(batch, page), range(nd)),
                         (fi.prefill_plan_arrays(batch, page), range(nd, batch.num_reqs))):
        if not len(rows):
            assert arrays is None
            continue
        got = as_lists(arrays, batch.block_table)
        for j, r in enumerate(rows):
            lo, hi = got["kv_indptr"][j], got["kv_indptr"][j + 1]
            assert got["kv_indices"][lo:hi] == tables[r]
            assert 1 <= got["kv_last_page_len"][j] <= page
            assert (hi - lo - 1) * page + got["kv_last_page_len"][j] == seq[r]
        if "qo_indptr" in got:
            assert np.diff(got["qo_indptr"]).tolist() == queries[nd:]


def test_availability_without_a_gpu(monkeypatch):
    assert fi.is_available("cpu") == (False, "needs a CUDA GPU (device is cpu)")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flashinfer" else real(name, *a))
    assert fi.is_available("cuda") == (False, "flashinfer-python is not installed: pip install 'paged[flashinfer]'")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flashinfer" else real(name, *a))
    assert fi.is_available("cuda") == (True, "")


def test_selecting_it_on_the_cpu_fails_naming_the_working_backends(monkeypatch):
    from paged.core.config import load_config, resolve_plugins
    from paged.core.errors import ConfigError
    from paged.core.registry import get_registry

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    spec = get_registry().attention_backend("flashinfer")
    assert spec.auto_priority == 20 and spec.options is fi.FlashInferOptions
    with pytest.raises(ConfigError) as e:
        resolve_plugins(load_config(overrides={"attention": {"backend": "flashinfer"}}), device="cpu")
    assert str(e.value) == (
        "attention.backend: 'flashinfer' cannot run here: needs a CUDA GPU (device is cpu). "
        "Backends that work on this machine: torch."
    )
    # the backend itself refuses a CPU layout before importing flashinfer
    layout = AttentionLayout(1, 4, 2, 64, 16, torch.bfloat16, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        fi.FlashInferAttentionBackend(layout)


def test_auto_prefers_flashinfer_on_cuda(monkeypatch):
    from paged.core.config import load_config, resolve_plugins

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name in ("flashinfer", "triton")
                        else real(name, *a))
    assert resolve_plugins(load_config(), device="cuda").attention.name == "flashinfer"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "triton" else
                        None if name == "flashinfer" else real(name, *a))
    assert resolve_plugins(load_config(), device="cuda").attention.name == "triton"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("flashinfer", "triton")
                        else real(name, *a))
    assert resolve_plugins(load_config(), device="cuda").attention.name == "torch"


# ---- per-layer settings: window, soft-cap, scale in the plan -----------------------------------


def test_window_leaves_out_the_pages_no_query_sees():
    # page size 4, window 6. decodes: 13 cached + 1 -> 14 tokens in [7, 3, 1, 9]: the query at 13
    # sees 8..13, so pages 0 and 1 (0..7) are left out; 5 + 1 -> 6 in [4, 2]: sees 0..5, nothing out.
    # prefill: 10 cached + 4 new -> 14 in [2, 8, 5, 6]: the first query (10) sees 5..: page 0 out;
    # a fresh prompt of 9 in [10, 11, 12]: nothing out
    from paged.core.attention import AttentionSettings

    tables = [[7, 3, 1, 9], [4, 2], [2, 8, 5, 6], [10, 11, 12]]
    batch = make_batch(tables, [13, 5, 10, 0], [1, 1, 4, 9], block_size=4)
    assert as_lists(fi.decode_plan_arrays(batch, 4, window=6), batch.block_table) == {
        "kv_indptr": [0, 2, 4],
        "kv_indices": [1, 9, 4, 2],
        "kv_last_page_len": [2, 2],  # the KV lengths FlashInfer sees: 6 (8..13) and 6
    }
    assert as_lists(fi.prefill_plan_arrays(batch, 4, window=6), batch.block_table) == {
        "qo_indptr": [0, 4, 13],
        "kv_indptr": [0, 3, 6],
        "kv_indices": [8, 5, 6, 10, 11, 12],
        "kv_last_page_len": [2, 1],
    }
    # without a window (or one wider than every context) nothing is left out
    assert fi.decode_plan_arrays(batch, 4, window=100).kv_indptr.tolist() == [0, 4, 6]

    layout = AttentionLayout(1, 4, 2, 64, 4, torch.bfloat16, torch.device("cpu"))
    assert fi.plan_options(layout, AttentionSettings()) == {"sm_scale": 64**-0.5, "window_left": -1,
                                                            "logits_soft_cap": None}
    assert fi.plan_options(layout, AttentionSettings(6, 50.0, 0.25)) == {"sm_scale": 0.25, "window_left": 5,
                                                                         "logits_soft_cap": 50.0}


class RecordingWrapper:
    """Stands for a FlashInfer wrapper: records what ``plan`` got."""

    def __init__(self):
        self.calls = []

    def plan(self, *args, **kwargs):
        self.calls.append((args, kwargs))


def test_plan_step_passes_the_layer_settings_to_both_wrappers():
    from paged.core.attention import AttentionSettings

    layout = AttentionLayout(1, 4, 2, 64, 4, torch.bfloat16, torch.device("cpu"))
    batch = make_batch([[7, 3, 1, 9], [2, 8, 5, 6]], [13, 10], [1, 4], block_size=4)
    decode, prefill = RecordingWrapper(), RecordingWrapper()
    d_arrays, p_arrays = fi.plan_step(layout, batch, AttentionSettings(6, 30.0, 0.2), decode, prefill)
    (d_args, d_kw), = decode.calls
    (p_args, p_kw), = prefill.calls
    assert d_args[1].tolist() == [1, 9] and p_args[2].tolist() == [8, 5, 6]  # only the pages in the window
    assert d_args[3:] == p_args[4:] == (4, 2, 64, 4)  # heads, kv heads, head dim, page size
    for kw in (d_kw, p_kw):
        assert (kw["sm_scale"], kw["window_left"], kw["logits_soft_cap"]) == (0.2, 5, 30.0)
        assert kw["q_data_type"] == kw["kv_data_type"] == torch.bfloat16
    assert p_kw["causal"] is True
    assert d_arrays.kv_indptr.tolist() == [0, 2] and p_arrays.qo_indptr.tolist() == [0, 4]
