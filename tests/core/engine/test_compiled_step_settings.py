"""model.compile with per-layer attention settings: the custom op ``paged::attention`` carries a
layer's sliding window, soft-cap and scale to the real backend (traced by dynamo as constants of
the graph), and gives what the backend's own ``forward`` with those settings gives."""

from __future__ import annotations

import torch

from paged.backends.torch_attention import TorchAttentionBackend
from paged.core.attention import AttentionLayout, AttentionSettings
from paged.core.engine import compiled_step
from paged.core.engine.compiled_step import OpaqueAttention

from helpers.batch import make_batch

SETTINGS = [AttentionSettings(), AttentionSettings(sliding_window=3, logits_soft_cap=2.0, scale=0.2),
            AttentionSettings(sliding_window=5)]


def _case():
    layout = AttentionLayout(len(SETTINGS), 4, 2, 16, 4, torch.float32, torch.device("cpu"))
    backend = TorchAttentionBackend(layout)
    gen = torch.Generator().manual_seed(0)
    batch = make_batch([[3, 1, 4], [2, 5]], [7, 0], [1, 6], 4)  # a decode after 7 tokens, a prefill of 6
    q = torch.randn(7, 4, 16, generator=gen) * 3
    k, v = torch.randn(7, 2, 16, generator=gen), torch.randn(7, 2, 16, generator=gen)
    caches = backend.allocate_kv_cache(6)
    for kc, vc in caches:
        kc.normal_(generator=gen), vc.normal_(generator=gen)
    return backend, batch, q, k, v, caches


def test_the_op_passes_each_layers_settings_to_the_backend():
    backend, batch, q, k, v, caches = _case()
    expected = []
    for layer, settings in enumerate(SETTINGS):
        kw = {} if settings.is_default else {"settings": settings}
        copy = (caches[layer][0].clone(), caches[layer][1].clone())
        expected.append(backend.forward(q, k, v, copy, backend.build_metadata(batch), **kw))
    opaque = OpaqueAttention(backend)

    def layers(q, k, v, metadata):  # what a compiled model does: layer indices for the caches
        return [opaque.forward(q, k, v, i, metadata, **({} if s.is_default else {"settings": s}))
                for i, s in enumerate(SETTINGS)]

    compiled = torch.compile(layers, backend="eager", fullgraph=True)  # dynamo traces the op, no inductor
    compiled_step._step["kv_caches"], compiled_step._step["metadata"] = caches, backend.build_metadata(batch)
    try:
        got = compiled(q, k, v, compiled_step._step["metadata"])
    finally:
        compiled_step._step["kv_caches"] = compiled_step._step["metadata"] = None
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=0, rtol=0)
    assert not torch.equal(got[0], got[1])  # the settings made a difference


def test_eager_forward_of_the_opaque_backend_passes_settings():
    backend, batch, q, k, v, caches = _case()
    s = SETTINGS[1]
    want = backend.forward(q, k, v, (caches[1][0].clone(), caches[1][1].clone()), backend.build_metadata(batch), settings=s)
    got = OpaqueAttention(backend).forward(q, k, v, caches[1], backend.build_metadata(batch), settings=s)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_inductor_cache_key_changes_with_the_ops_schemas():
    """A graph compiled by a paged whose ops took other arguments must not be reused from
    inductor's on-disk cache (it was: decode then computed garbage after an upgrade). The cache
    key carries a pass whose uuid hashes the schemas of every ``paged*`` op."""
    from paged.core.engine.compiled_step import CompiledForward, _op_schema_in_cache_key

    key_pass = _op_schema_in_cache_key()
    before = key_pass.uuid()
    assert before == key_pass.uuid()  # stable: the same in every process with the same ops

    @torch.library.custom_op("paged_probe::schema_probe", mutates_args=())
    def probe(x: torch.Tensor, extra: int = 0) -> torch.Tensor:
        return x.clone()

    assert key_pass.uuid() != before
    CompiledForward(torch.nn.Linear(2, 2), max_tokens=2)
    assert CompiledForward.DEFAULT_OPTIONS.get("post_grad_custom_post_pass") is None  # the class default untouched
