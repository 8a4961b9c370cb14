"""The torch reference backend against a brute-force float64 attention.

The reference (``reference_attention``) loops over heads of one request and reads contiguous K/V
that the test keeps itself; nothing is ever read back from the paged cache. Every cache starts
filled with NaN, so a read of an unused block, of a padding entry of a block table (0) or of the
stale tail of a request's last block shows up as a non-finite output.
"""

from __future__ import annotations

import random

import pytest
import torch

from paged.backends.torch_attention import TorchAttentionBackend, TorchAttentionOptions
from paged.core.attention import AttentionBackend, AttentionLayout
from paged.core.utils import cdiv

from helpers.batch import make_batch

TOLERANCE = {  # (atol, rtol) against float64 on inputs already rounded to the dtype
    torch.float32: (2e-5, 1e-5),
    torch.bfloat16: (6e-2, 3e-2),
    torch.float16: (8e-3, 5e-3),
}
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")]),
]


# ---- helpers ---------------------------------------------------------------------------------


def make_layout(num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32, device="cpu", layers=1):
    return AttentionLayout(layers, num_heads, num_kv_heads, head_dim, block_size, dtype, torch.device(device))


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One request, float64: ``q`` [q_len, H, D] are the last q_len of the ``k``/``v`` [S, Hkv, D]
    positions; query t sees positions <= S - q_len + t."""
    q, k, v = q.double(), k.double(), v.double()
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    allowed = torch.arange(seq_len)[None, :] <= (seq_len - q_len + torch.arange(q_len))[:, None]
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(num_heads):
        scores = q[:, h] @ k[:, h // group].T * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, h // group]
    return out


def run_scenario(
    requests,  # list of (computed_len, query_len): decodes (c > 0, q == 1) first
    *,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    block_size=4,
    dtype=torch.float32,
    device="cpu",
    layers=1,
    prefix_via_forward=True,
    spare_blocks=3,
    seed=0,
    kernel=True,
):
    """Cache each request's prefix (through an earlier forward step with its own slot mapping,
    or written directly), then run one mixed step and check every layer against the reference.
    Blocks are handed out shuffled; block 0 (the block-table padding) and some spare blocks
    stay unused and NaN. ``kernel``: the options ``cpu_decode_kernel`` and ``cpu_prefill_kernel``
    (CPU decodes through the fused kernel and bf16 prefills of head dim 64/128 through the causal
    one, else gather + SDPA)."""
    gen = torch.Generator().manual_seed(seed)
    layout = make_layout(num_heads, num_kv_heads, head_dim, block_size, dtype, device, layers)
    backend = TorchAttentionBackend(layout, TorchAttentionOptions(cpu_decode_kernel=kernel, cpu_prefill_kernel=kernel))
    if kernel and layout.device.type == "cpu":  # a "kernel" case must run the kernel, not the fallback
        assert backend._kernel is not None, "cpu_paged_decode did not load"
    seq_lens = [c + q for c, q in requests]
    num_blocks = 1 + sum(cdiv(s, block_size) for s in seq_lens) + spare_blocks
    free = list(range(1, num_blocks))
    random.Random(seed).shuffle(free)
    block_tables = [[free.pop() for _ in range(cdiv(s, block_size))] for s in seq_lens]

    caches = backend.allocate_kv_cache(num_blocks)
    for k_cache, v_cache in caches:
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))

    def rand(*shape):  # rounded to the dtype: the reference sees exactly what the backend sees
        return torch.randn(*shape, generator=gen).to(dtype)

    # the test's own contiguous K/V per layer and request, and the queries of the mixed step
    ctx_k = [[rand(s, num_kv_heads, head_dim) for s in seq_lens] for _ in range(layers)]
    ctx_v = [[rand(s, num_kv_heads, head_dim) for s in seq_lens] for _ in range(layers)]
    queries = [rand(q, num_heads, head_dim) for _, q in requests]

    # 1. cache the prefixes
    cached = [i for i, (c, _) in enumerate(requests) if c > 0]
    if prefix_via_forward and cached:
        batch = make_batch([block_tables[i] for i in cached], [0] * len(cached), [requests[i][0] for i in cached],
                           block_size, device)
        meta = backend.build_metadata(batch)
        prefix_q = [rand(requests[i][0], num_heads, head_dim) for i in cached]
        for layer in range(layers):
            key = torch.cat([ctx_k[layer][i][: requests[i][0]] for i in cached]).to(device)
            value = torch.cat([ctx_v[layer][i][: requests[i][0]] for i in cached]).to(device)
            out = backend.forward(torch.cat(prefix_q).to(device), key, value, caches[layer], meta)
            check(out, [(pq, ctx_k[layer][i][: requests[i][0]], ctx_v[layer][i][: requests[i][0]])
                        for pq, i in zip(prefix_q, cached)], layout)
    else:
        for layer in range(layers):
            k_cache, v_cache = caches[layer]
            for i in cached:
                for p in range(requests[i][0]):
                    k_cache[block_tables[i][p // block_size], p % block_size] = ctx_k[layer][i][p]
                    v_cache[block_tables[i][p // block_size], p % block_size] = ctx_v[layer][i][p]

    # 2. the mixed step: all layers share one metadata
    batch = make_batch(block_tables, [c for c, _ in requests], [q for _, q in requests], block_size, device)
    meta = backend.build_metadata(batch)
    for layer in range(layers):
        key = torch.cat([ctx_k[layer][i][c:] for i, (c, _) in enumerate(requests)]).to(device)
        value = torch.cat([ctx_v[layer][i][c:] for i, (c, _) in enumerate(requests)]).to(device)
        out = backend.forward(torch.cat(queries).to(device), key, value, caches[layer], meta)
        check(out, [(queries[i], ctx_k[layer][i], ctx_v[layer][i]) for i in range(len(requests))], layout)
    return backend, caches, block_tables


def check(out, per_request, layout):
    """``per_request``: (queries, full K, full V) in batch order."""
    assert out.shape == (sum(q.shape[0] for q, _, _ in per_request), layout.num_heads, layout.head_dim)
    assert out.dtype == layout.dtype
    assert torch.isfinite(out).all(), "read a NaN slot: an unused block, a padding entry or a stale tail"
    expected = torch.cat([reference_attention(q, k, v, layout.scale) for q, k, v in per_request])
    atol, rtol = TOLERANCE[layout.dtype]
    torch.testing.assert_close(out.cpu().double(), expected, atol=atol, rtol=rtol)


# ---- tests -----------------------------------------------------------------------------------


def test_slot_mapping_writes_to_block_and_offset():
    layout = make_layout(num_heads=2, num_kv_heads=2, head_dim=3, block_size=4)
    backend = TorchAttentionBackend(layout)
    assert isinstance(backend, AttentionBackend)
    [(k_cache, v_cache)] = backend.allocate_kv_cache(6)
    assert k_cache.shape == (6, 4, 2, 3) and torch.count_nonzero(k_cache) == 0
    # one request of 6 tokens in blocks [5, 2]: tokens 0-3 -> block 5, offsets 0-3; 4-5 -> block 2, offsets 0-1
    batch = make_batch([[5, 2]], [0], [6], block_size=4)
    assert batch.slot_mapping.tolist() == [20, 21, 22, 23, 8, 9]
    key = torch.arange(1, 7, dtype=torch.float32)[:, None, None].expand(6, 2, 3)  # token t -> t + 1
    value = -key
    backend.forward(torch.randn(6, 2, 3), key, value, (k_cache, v_cache), backend.build_metadata(batch))
    expected = torch.zeros(6, 4, 2, 3)
    expected[5, 0:4] = torch.tensor([1.0, 2, 3, 4])[:, None, None]
    expected[2, 0:2] = torch.tensor([5.0, 6])[:, None, None]
    assert torch.equal(k_cache, expected)
    assert torch.equal(v_cache, -expected)
    # a decode of token 6 lands in block 2, offset 2
    batch = make_batch([[5, 2]], [6], [1], block_size=4)
    assert batch.slot_mapping.tolist() == [10] and batch.num_decodes == 1
    backend.forward(torch.randn(1, 2, 3), torch.full((1, 2, 3), 7.0), torch.full((1, 2, 3), -7.0),
                    (k_cache, v_cache), backend.build_metadata(batch))
    expected[2, 2] = 7.0
    assert torch.equal(k_cache, expected) and torch.equal(v_cache, -expected)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "gather"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 2), (9, 3), (2, 2)])
def test_mixed_batch_fp32(block_size, heads, kernel):
    # decodes of uneven lengths (a multiple of the block size, one token past it, a single token
    # of context), then chunks after a cached prefix, one without, one of a single token
    requests = [(16, 1), (4, 1), (1, 1), (23, 1), (12, 7), (0, 9), (5, 1), (30, 3)]
    run_scenario(requests, num_heads=heads[0], num_kv_heads=heads[1], block_size=block_size, seed=block_size,
                 kernel=kernel)


@pytest.mark.parametrize("seed", range(8))
def test_random_shapes(seed):
    rng = random.Random(seed)
    decodes = [(rng.randint(1, 40), 1) for _ in range(rng.randint(0, 6))]
    prefills = [(rng.choice([0, rng.randint(1, 30)]), rng.randint(1, 20)) for _ in range(rng.randint(0, 3))]
    requests = decodes + prefills or [(0, 5)]
    num_kv_heads = rng.choice([1, 2, 3])
    run_scenario(
        requests,
        num_heads=num_kv_heads * rng.choice([1, 2, 3]),
        num_kv_heads=num_kv_heads,
        head_dim=rng.choice([8, 16, 32]),
        block_size=rng.choice([1, 2, 4, 16]),
        prefix_via_forward=rng.random() < 0.5,
        seed=seed,
        kernel=seed % 2 == 0,
    )


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "gather"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_half(dtype, device, kernel):
    requests = [(40, 1), (7, 1), (33, 1), (20, 12), (0, 17)]
    run_scenario(requests, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype, device=device,
                 kernel=kernel)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "gather"])
@pytest.mark.parametrize("device", DEVICES)
def test_layers_share_metadata(device, kernel):
    # three layers, one metadata per step: the gather buffers are reused and must not leak across
    run_scenario([(9, 1), (3, 1), (6, 5)], layers=3, block_size=4, device=device, prefix_via_forward=False,
                 kernel=kernel)


def test_decodes_without_padding_and_prefill_only():
    run_scenario([(15, 1), (15, 1), (7, 1)], block_size=8)  # all end exactly at a block boundary
    run_scenario([(15, 1), (15, 1), (7, 1)], block_size=8, kernel=False)
    run_scenario([(0, 13), (0, 1), (8, 8)], block_size=4)  # no decodes
    run_scenario([(31, 1)], block_size=16, prefix_via_forward=False)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "gather"])
def test_block_zero_in_use_and_unused_blocks_untouched(kernel):
    # block 0 is real here and also the padding value of block tables: the padding must be
    # masked even though it holds finite data, and a step writes only its own slots
    layout = make_layout(num_heads=4, num_kv_heads=2, head_dim=8, block_size=2)
    backend = TorchAttentionBackend(layout, TorchAttentionOptions(cpu_decode_kernel=kernel))
    if kernel:
        assert backend._kernel is not None, "cpu_paged_decode did not load"
    [(k_cache, v_cache)] = backend.allocate_kv_cache(8)
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))
    gen = torch.Generator().manual_seed(1)
    lens = [3, 5]
    k = [torch.randn(n + 1, 2, 8, generator=gen) for n in lens]  # prompt + one decoded token
    v = [torch.randn(n + 1, 2, 8, generator=gen) for n in lens]
    tables = [[0, 6], [7, 1, 4]]
    backend.forward(torch.randn(8, 4, 8), torch.cat([k[0][:3], k[1][:5]]), torch.cat([v[0][:3], v[1][:5]]),
                    (k_cache, v_cache), backend.build_metadata(make_batch(tables, [0, 0], lens, 2)))
    for unused in (k_cache[[2, 3, 5]], v_cache[[2, 3, 5]], k_cache[[6, 4], 1], v_cache[[6, 4], 1]):
        assert torch.isnan(unused).all()
    # decode: request 0 gathers [0, 6, 0 (padding)]
    q = torch.randn(2, 4, 8, generator=gen)
    out = backend.forward(q, torch.stack([k[0][3], k[1][5]]), torch.stack([v[0][3], v[1][5]]), (k_cache, v_cache),
                          backend.build_metadata(make_batch(tables, lens, [1, 1], 2)))
    check(out, [(q[i : i + 1], k[i], v[i]) for i in range(2)], layout)


def test_output_dtype_follows_query():
    # bf16 cache, fp32 activations: attention runs in the cache dtype, the output is fp32
    layout = make_layout(dtype=torch.bfloat16)
    backend = TorchAttentionBackend(layout)
    [kv] = backend.allocate_kv_cache(4)
    batch = make_batch([[2, 3]], [0], [6], block_size=4)
    out = backend.forward(torch.randn(6, 4, 16), torch.randn(6, 2, 16), torch.randn(6, 2, 16), kv,
                          backend.build_metadata(batch))
    assert out.dtype == torch.float32 and out.shape == (6, 4, 16) and torch.isfinite(out).all()


def test_rejects_uneven_gqa():
    with pytest.raises(ValueError, match="multiple"):
        TorchAttentionBackend(make_layout(num_heads=5, num_kv_heads=2))


def test_plugin_registers_torch_backend():
    import paged.plugins.attention as plugin
    from paged.core.registry import load_plugins

    registry = load_plugins(entry_points=[], modules=[("torch_attention", plugin)], allow=None, deny=set())
    spec = registry.attention_backend("torch")
    assert spec.factory is TorchAttentionBackend and spec.options is TorchAttentionOptions
    assert spec.is_available("cpu") == (True, "") and spec.auto_priority == 0
    assert spec.factory(make_layout(), None).name == "torch"
    assert spec.factory(make_layout(), None).options.cpu_decode_kernel  # on by default
