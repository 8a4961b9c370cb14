"""The rope variants of ``paged.models.rotary`` against HF transformers' own rotary embeddings
(``modeling_rope_utils`` through each model's ``RotaryEmbedding`` module, which also applies the
dynamic and longrope updates and the attention scaling), on tiny configs whose scaling changes
short contexts: the cos/sin tables at every position the engine can run must agree."""

from __future__ import annotations

import pytest
import torch
import transformers

from paged.core.errors import ModelLoadError
from paged.models.rotary import RotaryEmbedding, rope_settings, rotary_dim_of

SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
HEAD_DIM = 16

LLAMA_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 3.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "mscale": 0.7,
                    "mscale_all_dim": 0.9, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                              "attention_factor": 1.3},
}


def _hf_cos_sin(rotary: torch.nn.Module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    half = cos.shape[-1] // 2  # HF repeats the frequencies: cat(freqs, freqs)
    return cos[0, :, :half], sin[0, :, :half]


def _ours(config) -> RotaryEmbedding:
    return RotaryEmbedding.from_config(config, HEAD_DIM)


@pytest.mark.parametrize("name", list(LLAMA_SCALINGS))
def test_llama_scalings_match_hf(name):
    config = transformers.LlamaConfig(**SMALL, rope_theta=10000.0, rope_scaling=dict(LLAMA_SCALINGS[name]))
    hf = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    ours = _ours(config)
    positions = torch.arange(config.max_position_embeddings)  # every position the engine can run
    cos, sin = _hf_cos_sin(hf, positions)
    assert ours.cos.shape == (128, HEAD_DIM // 2)
    torch.testing.assert_close(ours.cos, cos, atol=2e-6, rtol=0)
    torch.testing.assert_close(ours.sin, sin, atol=2e-6, rtol=0)
    if name != "dynamic":  # dynamic NTK only differs past max_position_embeddings
        plain = RotaryEmbedding(HEAD_DIM, 128, 10000.0)
        assert not torch.allclose(ours.cos, plain.cos, atol=1e-3)


def _phi3_config(partial: float, **rope) -> transformers.Phi3Config:
    half = int(HEAD_DIM * partial) // 2
    scaling = {"rope_type": "longrope", "short_factor": [1.0 + 0.15 * i for i in range(half)],
               "long_factor": [1.5 + 0.5 * i for i in range(half)], **rope}
    return transformers.Phi3Config(**SMALL, original_max_position_embeddings=32, partial_rotary_factor=partial,
                                   rope_scaling=scaling)


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_longrope_short_then_long_factors_match_hf(partial):
    config = _phi3_config(partial)
    hf = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(config)
    ours = _ours(config)
    assert ours.rotary_dim == int(HEAD_DIM * partial) == rotary_dim_of(config, HEAD_DIM)
    # HF picks the short factors while the sequence fits the pretraining context (32) ...
    short = torch.arange(32)
    cos, sin = _hf_cos_sin(hf, short)
    torch.testing.assert_close(ours.cos[:32], cos, atol=2e-6, rtol=0)
    torch.testing.assert_close(ours.sin[:32], sin, atol=2e-6, rtol=0)
    # ... and the long ones for the tokens after it (each decode step past 32)
    later = torch.arange(32, 128)
    for pos in (later[:1], later[-1:], later):
        cos, sin = _hf_cos_sin(hf, pos)
        torch.testing.assert_close(ours.cos[pos], cos, atol=2e-6, rtol=0)
        torch.testing.assert_close(ours.sin[pos], sin, atol=2e-6, rtol=0)
    assert hf.attention_scaling > 1.0  # the attention factor really is applied (128 / 32 > 1)


def test_su_is_longrope_and_takes_the_original_context_beside_the_scaling():
    """Phi-3's first configs: ``type: su`` and ``original_max_position_embeddings`` outside
    rope_scaling (as a transformers 4.x config object holds them)."""
    longrope = _phi3_config(1.0)
    legacy = transformers.PretrainedConfig(
        rope_theta=10000.0, max_position_embeddings=128, original_max_position_embeddings=32,
        rope_scaling={"type": "su", "short_factor": longrope.rope_parameters["short_factor"],
                      "long_factor": longrope.rope_parameters["long_factor"]},
    )
    theta, scaling = rope_settings(legacy)
    assert theta == 10000.0 and scaling["original_max_position_embeddings"] == 32
    got = RotaryEmbedding(HEAD_DIM, 128, theta, scaling)
    want = _ours(longrope)
    torch.testing.assert_close(got.cos, want.cos, atol=0, rtol=0)
    torch.testing.assert_close(got.sin, want.sin, atol=0, rtol=0)


def test_partial_rotary_rotates_only_the_leading_dimensions():
    config = transformers.LlamaConfig(**SMALL, rope_theta=10000.0, partial_rotary_factor=0.5)
    ours = _ours(config)
    assert ours.rotary_dim == 8
    q, k = torch.randn(5, 4, HEAD_DIM), torch.randn(5, 2, HEAD_DIM)
    positions = torch.tensor([0, 3, 7, 50, 127])
    q2, k2 = ours(positions, q, k)
    torch.testing.assert_close(q2[..., 8:], q[..., 8:], atol=0, rtol=0)
    torch.testing.assert_close(k2[..., 8:], k[..., 8:], atol=0, rtol=0)
    full = RotaryEmbedding(8, 128, 10000.0)
    q_rot, k_rot = full(positions, q[..., :8].contiguous(), k[..., :8].contiguous())
    torch.testing.assert_close(q2[..., :8], q_rot, atol=1e-6, rtol=0)
    torch.testing.assert_close(k2[..., :8], k_rot, atol=1e-6, rtol=0)


@pytest.mark.parametrize("scaling, field", [
    ({"rope_type": "linear"}, "'factor'"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "original_max_position_embeddings": 32}, "'long_factor'"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 3,
      "original_max_position_embeddings": 32}, "short_factor has 3 entries"),
])
def test_bad_rope_parameters_are_named(scaling, field):
    with pytest.raises(ModelLoadError, match=field):
        RotaryEmbedding(HEAD_DIM, 128, 10000.0, scaling)


def test_bad_partial_rotary_factor_is_named():
    config = transformers.PretrainedConfig(rope_theta=10000.0, max_position_embeddings=128, partial_rotary_factor=0.1)
    with pytest.raises(ModelLoadError, match="partial_rotary_factor: 0.1"):
        RotaryEmbedding.from_config(config, HEAD_DIM)
