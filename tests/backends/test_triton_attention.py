"""The Triton backend against the torch reference backend, on the CPU through the Triton
interpreter (``TRITON_INTERPRET=1``, set by an autouse fixture before any backend is built: the
kernels are built, and Triton reads the variable, when the first backend is constructed).

Each scenario runs both backends on identical inputs: every cache starts filled with NaN (a read
of an unused block, a block-table padding entry or a stale tail shows up as a non-finite output),
the prefixes are cached by an earlier step through each backend's own ``forward``, then one mixed
step (decodes first, then prefill chunks after a cached prefix or without one) is checked: the
outputs agree within the dtype's tolerance and the caches are bit-identical (NaN included).

The interpreter is slow (tens of ms per program and key step): shapes stay tiny.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

# Triton jits its standard library (tl.zeros, tl.max, ...) when it is first imported: import it in
# interpreter mode, then restore the environment (the fixture below sets it again per test, so
# that the rest of the session does not see the Triton backend as available on the CPU).
_saved = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    pytest.importorskip("triton")
finally:
    if _saved is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _saved

from paged.backends.torch_attention import TorchAttentionBackend  # noqa: E402
from paged.backends.triton_attention import (  # noqa: E402
    TritonAttentionBackend,
    TritonAttentionOptions,
    is_available,
    tile_map,
)
from paged.core.attention import AttentionLayout  # noqa: E402
from paged.core.utils import cdiv  # noqa: E402

from helpers.batch import make_batch  # noqa: E402

TOLERANCE = {  # (atol, rtol) between the two backends, both in the cache dtype
    torch.float32: (1e-5, 1e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}
SMALL = TritonAttentionOptions(block_m_decode=16, block_m_prefill=16, block_n=16)


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# ---- helpers ---------------------------------------------------------------------------------


def make_layout(num_heads=2, num_kv_heads=1, head_dim=64, block_size=4, dtype=torch.float32, layers=1):
    return AttentionLayout(layers, num_heads, num_kv_heads, head_dim, block_size, dtype, torch.device("cpu"))


def compare(requests, *, options=SMALL, layers=1, seed=0, query_dtype=None, block_tables=None, **layout_kw):
    """``requests``: (computed_len, query_len) pairs, decodes (c > 0, q == 1) first."""
    gen = torch.Generator().manual_seed(seed)
    layout = make_layout(layers=layers, **layout_kw)
    dtype, bs = layout.dtype, layout.block_size
    triton_backend = TritonAttentionBackend(layout, options)
    torch_backend = TorchAttentionBackend(layout)
    seq_lens = [c + q for c, q in requests]
    if block_tables is None:
        num_blocks = 1 + sum(cdiv(s, bs) for s in seq_lens) + 2
        free = list(range(1, num_blocks))  # block 0 stays unused: it is the block-table padding
        random.Random(seed).shuffle(free)
        block_tables = [[free.pop() for _ in range(cdiv(s, bs))] for s in seq_lens]
    num_blocks = max(max(b) for b in block_tables) + 3
    caches = {}
    for name, backend in (("triton", triton_backend), ("torch", torch_backend)):
        caches[name] = backend.allocate_kv_cache(num_blocks)
        for k_cache, v_cache in caches[name]:
            k_cache.fill_(float("nan"))
            v_cache.fill_(float("nan"))

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(query_dtype or dtype)

    H, Hkv, D = layout.num_heads, layout.num_kv_heads, layout.head_dim
    keys = [[rand(s, Hkv, D) for s in seq_lens] for _ in range(layers)]
    values = [[rand(s, Hkv, D) for s in seq_lens] for _ in range(layers)]

    def step(rows, computed, new):
        batch = make_batch([block_tables[i] for i in rows], computed, new, bs)
        metas = {"triton": triton_backend.build_metadata(batch), "torch": torch_backend.build_metadata(batch)}
        for layer in range(layers):
            q = rand(batch.num_tokens, H, D)
            k = torch.cat([keys[layer][i][c : c + n] for i, c, n in zip(rows, computed, new)])
            v = torch.cat([values[layer][i][c : c + n] for i, c, n in zip(rows, computed, new)])
            out_triton = triton_backend.forward(q, k, v, caches["triton"][layer], metas["triton"])
            out_torch = torch_backend.forward(q, k, v, caches["torch"][layer], metas["torch"])
            assert out_triton.dtype == q.dtype and out_triton.shape == q.shape
            assert torch.isfinite(out_triton).all(), "read a NaN slot: an unused block, a padding entry or a stale tail"
            atol, rtol = TOLERANCE[dtype]
            torch.testing.assert_close(out_triton, out_torch, atol=atol, rtol=rtol)
            for a, b in zip(caches["triton"][layer], caches["torch"][layer]):
                torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)

    cached = [i for i, (c, _) in enumerate(requests) if c > 0]
    if cached:  # the prefixes, as one prefill step
        step(cached, [0] * len(cached), [requests[i][0] for i in cached])
    step(list(range(len(requests))), [c for c, _ in requests], [q for _, q in requests])
    return triton_backend


# ---- tests -----------------------------------------------------------------------------------


def test_tile_map():
    reqs, starts = tile_map(np.array([1, 9, 3, 8]), 2, 4)
    assert reqs.tolist() == [2, 3, 3, 3, 4, 5, 5]
    assert starts.tolist() == [0, 0, 4, 8, 0, 0, 4]


def test_write_kv_to_block_and_offset():
    layout = make_layout(num_heads=2, num_kv_heads=2, head_dim=3, block_size=4, dtype=torch.float16)
    backend = TritonAttentionBackend(layout, SMALL)
    [(k_cache, v_cache)] = backend.allocate_kv_cache(6)
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))
    # one request of 6 tokens in blocks [5, 2]: tokens 0-3 -> block 5, offsets 0-3; 4-5 -> block 2, offsets 0-1
    key = torch.arange(1, 7, dtype=torch.float32)[:, None, None].expand(6, 2, 3)  # fp32 into an fp16 cache
    backend.write_kv(key, -key, k_cache, v_cache, torch.tensor([20, 21, 22, 23, 8, 9]))
    expected = torch.full((6, 4, 2, 3), float("nan"), dtype=torch.float16)
    expected[5, 0:4] = torch.tensor([1.0, 2, 3, 4])[:, None, None]
    expected[2, 0:2] = torch.tensor([5.0, 6])[:, None, None]
    torch.testing.assert_close(k_cache, expected, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, -expected, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim,block_size", [(64, 4), (80, 8), (128, 16)])
def test_mixed_batch(head_dim, block_size, dtype):
    # decodes (a block boundary, one past it, a single cached token), then a chunk after a cached
    # prefix that spans two query tiles and a prompt without a prefix
    requests = [(16, 1), (9, 1), (1, 1), (12, 10), (0, 7)]
    compare(requests, head_dim=head_dim, block_size=block_size, dtype=dtype, seed=head_dim)


@pytest.mark.parametrize("heads", [(3, 1), (4, 2), (8, 1)])
def test_gqa_groups(heads):
    # group 3 is padded to 4 rows per token; group 8 leaves 2 query tokens per 16-row tile
    compare([(11, 1), (6, 9)], num_heads=heads[0], num_kv_heads=heads[1], head_dim=64, block_size=8)


@pytest.mark.parametrize("block_size", [1, 32])
def test_block_sizes(block_size):
    # one token per block (a block-table read per key), and blocks larger than the key step
    compare([(21, 1), (5, 12)], head_dim=64, block_size=block_size, seed=block_size)


@pytest.mark.parametrize("splits", [2, 3])
def test_split_kv(splits):
    # keys split across programs (more splits than key steps for the short ones), then merged
    options = TritonAttentionOptions(block_m_decode=16, block_m_prefill=16, block_n=16, num_kv_splits=splits)
    compare([(35, 1), (3, 1), (20, 6)], head_dim=64, block_size=8, options=options, seed=splits)


def test_bf16_cache_fp32_queries():
    # bf16 is upcast inside the kernel under the interpreter; activations stay fp32
    compare([(13, 1), (5, 8)], head_dim=64, block_size=4, dtype=torch.bfloat16, query_dtype=torch.float32)


def test_layers_share_metadata_and_larger_tiles():
    # default tile sizes (64-row prefill tiles, 64-key steps), two layers, one metadata
    compare([(9, 1), (3, 1), (6, 5)], head_dim=64, block_size=4, layers=2, options=TritonAttentionOptions())


def test_block_zero_in_use():
    # block 0 is a real block and also the padding value of the block table: masked all the same
    compare([(5, 1), (2, 3)], head_dim=64, block_size=2, block_tables=[[0, 6, 3], [7, 1, 4]])


def test_rejects_bad_layouts():
    with pytest.raises(ValueError, match="multiple"):
        TritonAttentionBackend(make_layout(num_heads=5, num_kv_heads=2))
    with pytest.raises(ValueError, match="power of two"):
        TritonAttentionOptions(block_n=8)


def test_availability(monkeypatch):
    assert is_available("cuda") == (True, "")
    assert is_available("cpu") == (True, "")  # under TRITON_INTERPRET=1
    monkeypatch.delenv("TRITON_INTERPRET")
    ok, reason = is_available("cpu")
    assert not ok and reason == "Triton kernels need a CUDA GPU; on the CPU they run only under TRITON_INTERPRET=1"
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        TritonAttentionBackend(make_layout())


def test_plugin_registers_backends(monkeypatch):
    from paged.core.config import load_config, resolve_plugins
    from paged.core.errors import ConfigError
    from paged.core.registry import get_registry

    specs = get_registry().attention_backends  # the bundled plugin, through its entry point
    assert {n: specs[n].auto_priority for n in ("torch", "triton", "flashinfer")} == {
        "torch": 0, "triton": 10, "flashinfer": 20,
    }
    assert specs["triton"].options is TritonAttentionOptions
    assert isinstance(specs["triton"].factory(make_layout(), None), TritonAttentionBackend)
    config = load_config(overrides={"attention": {"backend": "triton", "options": {"block_n": 32}}})
    assert resolve_plugins(config, device="cpu").attention_options.block_n == 32
    # auto: on a CUDA machine without flashinfer, triton; on the CPU (no interpreter), torch
    if not specs["flashinfer"].is_available("cuda")[0]:
        assert resolve_plugins(load_config(), device="cuda").attention.name == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert resolve_plugins(load_config(), device="cpu").attention.name == "torch"
    with pytest.raises(ConfigError, match="'triton' cannot run here: Triton kernels need a CUDA GPU.*work on this "
                       "machine: torch"):
        resolve_plugins(load_config(overrides={"attention": {"backend": "triton"}}), device="cpu")


# ---- the engine --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, default_model_dir):
    """A random-weight 2-layer Llama (hidden 64, 2 query heads / 1 KV head of 32) with the default
    model's tokenizer (vocab 49152), saved as an HF directory (fp32)."""
    import shutil
    from pathlib import Path

    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        # untied and not too small: with tied tiny weights the argmax is the input token whatever the
        # attention computes; like this a 10% error in the attention output changes the tokens
        tie_word_embeddings=False, initializer_range=0.1,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(default_model_dir) / name).is_file():
            shutil.copy(Path(default_model_dir) / name, path / name)
    return path


@pytest.mark.slow
def test_engine_greedy_parity_with_torch(tiny_llama):
    from paged import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "The capital of France is a city"]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    # chunked prefill (chunks of at most 5 tokens, 8 per step) and prefix caching (the shared
    # prompt start): steps mix decodes with chunks after a cached prefix
    settings = dict(device="cpu", block_size=4, max_num_batched_tokens=8, long_prefill_token_threshold=5)
    ids = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_llama), attention=backend, **settings)
        assert type(llm.engine.core.runner.backend).name == backend
        outputs = llm.generate(prompts, params, use_tqdm=False)
        ids[backend] = [o.outputs[0].token_ids for o in outputs]
    assert all(len(t) == 4 for t in ids["torch"])
    assert ids["triton"] == ids["torch"]


# ---- per-layer settings: sliding window, logit soft-cap, scale ---------------------------------

WINDOWED_REQUESTS = [(23, 1), (5, 1), (13, 9), (0, 19)]  # decodes longer and shorter than the window,
# a chunk after a cached prefix longer than the window, a fresh prompt longer than it


@pytest.mark.parametrize("settings", [
    dict(sliding_window=6),
    dict(sliding_window=8, logits_soft_cap=2.5, scale=0.11),
], ids=["window", "window-cap-scale"])
def test_layer_settings_against_float64(settings):
    """Against the float64 reference, with the blocks out of the window replaced by a NaN block
    (as the KV manager frees them): a read out of the window shows as a non-finite output."""
    from paged.core.attention import AttentionSettings

    from helpers.windowed_attention import run_windowed_scenario

    backend = TritonAttentionBackend(make_layout(num_heads=4, num_kv_heads=2, head_dim=64, block_size=4), SMALL)
    run_windowed_scenario(backend, WINDOWED_REQUESTS, AttentionSettings(**settings), tolerance=(3e-5, 1e-5))


def test_layer_settings_with_split_kv():
    from paged.core.attention import AttentionSettings

    from helpers.windowed_attention import run_windowed_scenario

    options = TritonAttentionOptions(block_m_decode=16, block_m_prefill=16, block_n=16, num_kv_splits=3)
    backend = TritonAttentionBackend(make_layout(num_heads=2, num_kv_heads=1, head_dim=64, block_size=8), options)
    run_windowed_scenario(backend, [(60, 1), (4, 1), (30, 5)], AttentionSettings(sliding_window=20, logits_soft_cap=5.0),
                          tolerance=(3e-5, 1e-5))
