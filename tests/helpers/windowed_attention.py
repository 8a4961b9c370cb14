"""An independent float64 attention with a sliding window, logit soft-capping and any scale,
and a two-step paged scenario that checks a backend against it, for the backend tests of the
per-layer attention settings (``paged.core.attention.AttentionSettings``).

The scenario keeps each request's K/V itself (contiguous, never read back from the paged cache).
Every cache starts filled with NaN; before the checked step, the block-table entries of blocks
that lie wholly out of the window of every query of the step are replaced by block 0 (NaN, never
written): what the KV manager does when it frees them. A backend that reads a position out of a
query's window then returns a non-finite output.
"""

from __future__ import annotations

import random

import torch

from paged.core.attention import AttentionSettings
from paged.core.utils import cdiv

from helpers.batch import make_batch


def reference_attention(q, k, v, scale: float, window: int | None = None, cap: float | None = None) -> torch.Tensor:
    """One request in float64: ``q`` [q_len, H, D] are the last q_len of the ``k``/``v`` [S, Hkv, D]
    positions; the query at position p sees key positions j with p - window < j <= p; scores are
    ``q.k * scale``, then ``cap * tanh(score / cap)``."""
    q, k, v = q.double(), k.double(), v.double()
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    key_pos = torch.arange(seq_len)[None, :]
    query_pos = (seq_len - q_len + torch.arange(q_len))[:, None]
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= key_pos > query_pos - window
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(num_heads):
        scores = q[:, h] @ k[:, h // group].T * scale
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, h // group]
    return out


def dead_blocks(computed: int, window: int | None, block_size: int) -> int:
    """Leading blocks no query at position >= ``computed`` can see (0 without a window)."""
    if window is None:
        return 0
    return max(0, computed - window + 1) // block_size


def run_windowed_scenario(backend, requests, settings: AttentionSettings, *, dtype=torch.float32, seed=0,
                          tolerance=(2e-5, 1e-5), check_reference=True):
    """``requests``: (computed_len, query_len), decodes (c > 0, q == 1) first. Step 1 caches each
    prefix through ``backend.forward`` (with ``settings``); step 2 (the checked mixed step) runs
    with the out-of-window blocks replaced by the NaN block 0. Returns the step-2 output and the
    float64 expectation."""
    layout = backend.layout
    gen = torch.Generator().manual_seed(seed)
    bs, hkv, h, d = layout.block_size, layout.num_kv_heads, layout.num_heads, layout.head_dim
    scale = settings.softmax_scale(d)
    kwargs = {} if settings.is_default else {"settings": settings}
    seq_lens = [c + q for c, q in requests]
    num_blocks = 1 + sum(cdiv(s, bs) for s in seq_lens) + 2
    free = list(range(1, num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(cdiv(s, bs))] for s in seq_lens]
    (k_cache, v_cache), = backend.allocate_kv_cache(num_blocks)[:1]
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))

    def rand(*shape, gain=1.0):  # rounded to the dtype: the reference sees what the backend sees
        return (torch.randn(*shape, generator=gen) * gain).to(dtype)

    gain = 3.0 if settings.logits_soft_cap is not None else 1.0  # large scores, so that the cap bites
    ks = [rand(s, hkv, d) for s in seq_lens]
    vs = [rand(s, hkv, d) for s in seq_lens]
    queries = [rand(q, h, d, gain=gain) for _, q in requests]
    window, cap = settings.sliding_window, settings.logits_soft_cap

    cached = [i for i, (c, _) in enumerate(requests) if c > 0]
    if cached:  # step 1: the prefixes, as prefill chunks without a cached prefix
        batch = make_batch([tables[i] for i in cached], [0] * len(cached), [requests[i][0] for i in cached], bs)
        meta = backend.build_metadata(batch)
        pq = [rand(requests[i][0], h, d, gain=gain) for i in cached]
        out = backend.forward(torch.cat(pq), torch.cat([ks[i][: requests[i][0]] for i in cached]),
                              torch.cat([vs[i][: requests[i][0]] for i in cached]), (k_cache, v_cache), meta, **kwargs)
        want = torch.cat([reference_attention(q, ks[i][: requests[i][0]], vs[i][: requests[i][0]], scale, window, cap)
                          for q, i in zip(pq, cached)])
        assert torch.isfinite(out).all()
        if check_reference:
            torch.testing.assert_close(out.double(), want, atol=tolerance[0], rtol=tolerance[1])

    # step 2: the blocks out of every query's window are gone (placeholder block 0, NaN)
    step_tables = [[0 if j < dead_blocks(c, window, bs) else b for j, b in enumerate(t)]
                   for t, (c, _) in zip(tables, requests)]
    batch = make_batch(step_tables, [c for c, _ in requests], [q for _, q in requests], bs)
    meta = backend.build_metadata(batch)
    key = torch.cat([ks[i][c:] for i, (c, _) in enumerate(requests)])
    value = torch.cat([vs[i][c:] for i, (c, _) in enumerate(requests)])
    out = backend.forward(torch.cat(queries), key, value, (k_cache, v_cache), meta, **kwargs)
    assert out.shape == (sum(q for _, q in requests), h, d)
    assert torch.isfinite(out).all(), "read a position out of the window (a freed block) or padding"
    want = torch.cat([reference_attention(queries[i], ks[i], vs[i], scale, window, cap) for i in range(len(requests))])
    if check_reference:
        torch.testing.assert_close(out.double(), want, atol=tolerance[0], rtol=tolerance[1])
    return out, want
