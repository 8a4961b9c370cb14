"""Per-layer attention settings (sliding window, logit soft-cap, scale) in the torch reference
backend, its fused CPU decode kernel and its gather fallback, against an independent float64
attention (``helpers.windowed_attention``); and the contract around them: what a backend
without the features gets, and that older backends keep working."""

from __future__ import annotations

import pytest
import torch

from paged.backends.torch_attention import TorchAttentionBackend, TorchAttentionOptions
from paged.core.attention import AttentionLayout, AttentionSettings, check_backend_supports
from paged.core.errors import ConfigError
from paged.models.layers import Attention, RotaryEmbedding

from helpers.windowed_attention import run_windowed_scenario

TOLERANCE = {torch.float32: (3e-5, 1e-5), torch.bfloat16: (6e-2, 3e-2)}

# decodes (context longer and shorter than the window), a chunk after a cached prefix longer than
# the window, a chunk whose cached prefix is inside the window, a fresh prompt longer than it
REQUESTS = [(23, 1), (5, 1), (17, 1), (13, 9), (3, 4), (0, 19), (0, 1)]
SETTINGS = [
    AttentionSettings(sliding_window=6),
    AttentionSettings(sliding_window=1),
    AttentionSettings(sliding_window=8, logits_soft_cap=2.5, scale=0.11),
    AttentionSettings(logits_soft_cap=3.0),
    AttentionSettings(scale=0.3),
    AttentionSettings(sliding_window=64),  # wider than every context: the same as none
]


def make_backend(kernel: bool, head_dim=16, dtype=torch.float32, heads=(4, 2), block_size=4) -> TorchAttentionBackend:
    layout = AttentionLayout(1, *heads, head_dim, block_size, dtype, torch.device("cpu"))
    backend = TorchAttentionBackend(layout, TorchAttentionOptions(cpu_decode_kernel=kernel))
    if kernel:
        assert backend._kernel is not None, "cpu_paged_decode did not load"
    return backend


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "gather"])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.features().items()))
def test_mixed_step_matches_reference(settings, kernel):
    run_windowed_scenario(make_backend(kernel), REQUESTS, settings, tolerance=TOLERANCE[torch.float32])


@pytest.mark.parametrize("head_dim", [64, 24])  # the kernel's compile-time and generic head dims
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_only_step_through_the_kernel(head_dim, dtype):
    """A step of decodes only: the fused write-and-decode call, window and soft-cap in C++."""
    backend = make_backend(True, head_dim, dtype, heads=(6, 2))
    settings = AttentionSettings(sliding_window=70, logits_soft_cap=4.0)
    run_windowed_scenario(backend, [(150, 1), (9, 1), (71, 1), (200, 1)], settings, dtype=dtype,
                          tolerance=TOLERANCE[dtype])


def test_batch_one_splits_the_window():
    """Batch 1 with a long window: the kernel's split-KV runs start at the window, not at 0."""
    backend = make_backend(True, 64, heads=(2, 1), block_size=16)
    run_windowed_scenario(backend, [(700, 1)], AttentionSettings(sliding_window=300), tolerance=(3e-5, 1e-5))


def test_soft_cap_changes_the_result():
    """The cap is applied (a reference without it disagrees): guards against a silently ignored cap."""
    out, _ = run_windowed_scenario(make_backend(True), [(20, 1), (0, 7)], AttentionSettings(logits_soft_cap=1.0))
    plain, _ = run_windowed_scenario(make_backend(True), [(20, 1), (0, 7)], AttentionSettings())
    assert (out - plain).abs().max() > 1e-2


# ---- the contract -----------------------------------------------------------------------------


class OldBackend:
    """A backend written against the first contract: no layer_features, forward without settings."""

    name = "old-style"

    def __init__(self, layout):
        self.inner = TorchAttentionBackend(layout)
        self.layout = layout

    def allocate_kv_cache(self, num_blocks):
        return self.inner.allocate_kv_cache(num_blocks)

    def build_metadata(self, batch):
        return self.inner.build_metadata(batch)

    def forward(self, query, key, value, kv_cache, metadata):
        return self.inner.forward(query, key, value, kv_cache, metadata)


def make_attention(backend, **settings) -> Attention:
    rotary = RotaryEmbedding(16, 64, 10000.0, None, device="cpu")
    return Attention(64, 4, 2, 16, rotary, backend, dtype=torch.float32, device="cpu", **settings)


def test_backend_without_the_feature_fails_at_build_time_naming_it():
    backend = OldBackend(AttentionLayout(1, 4, 2, 16, 4, torch.float32, torch.device("cpu")))
    with pytest.raises(ConfigError, match=r"'old-style' does not support sliding_window=8"):
        make_attention(backend, sliding_window=8)
    with pytest.raises(ConfigError, match=r"logits_soft_cap=50.0"):
        make_attention(backend, logits_soft_cap=50.0)
    with pytest.raises(ConfigError, match=r"scale=0.5"):
        make_attention(backend, scale=0.5)
    assert make_attention(backend, scale=16**-0.5).attn_settings.is_default  # the default scale is no feature


def test_old_backend_runs_a_layer_with_default_settings():
    from helpers.batch import make_batch

    layout = AttentionLayout(1, 4, 2, 16, 4, torch.float32, torch.device("cpu"))
    backend = OldBackend(layout)
    layer = make_attention(backend)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    caches = backend.allocate_kv_cache(4)
    meta = backend.build_metadata(make_batch([[1, 2]], [0], [5], 4))
    out = layer(torch.arange(5), torch.randn(5, 64), caches[0], meta)
    assert out.shape == (5, 64) and torch.isfinite(out).all()


def test_settings_are_checked():
    for bad in ({"sliding_window": 0}, {"sliding_window": 2.5}, {"logits_soft_cap": -1.0}, {"scale": float("inf")}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            AttentionSettings(**bad)
    check_backend_supports(make_backend(False), AttentionSettings(4, 30.0, 0.1))  # torch: all of them
