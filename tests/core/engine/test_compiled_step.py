"""model.compile: small steps through torch.compile with attention as an opaque custom op give
the eager engine's greedy tokens; what inductor cannot compile falls back to eager with one
warning; larger steps run eager."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from helpers.tiny_llama import save_tiny_llama

# Projections the int4 layout holds (multiples of 64), the default model's tokenizer.
INT4_TINY = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)


def _prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(100, 4000, n).tolist() for n in (7, 21)]


@pytest.mark.slow
def test_compiled_small_steps_give_the_eager_greedy_tokens(tmp_path, default_model_dir, caplog):
    from paged import LLM, SamplingParams
    from paged.core.engine.compiled_step import CompiledForward

    save_tiny_llama(tmp_path, default_model_dir, **INT4_TINY)
    model_dir = str(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    common = dict(device="cpu", dtype="float32", attention="torch", quantization="int4",
                  quantization_options={"dense_copy": False}, num_kv_blocks=64)
    eager = LLM(model_dir, **common)
    expected = [eager.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in _prompts()]
    together = [o.outputs[0].token_ids for o in eager.generate(_prompts(), params, use_tqdm=False)]

    calls = {"compiled": 0}
    with caplog.at_level(logging.INFO, logger="paged"):
        compiled = LLM(model_dir, **common, compile=True)
    forward = compiled.engine.core.runner.forward_model
    assert isinstance(forward, CompiledForward) and not forward.failed
    assert any("model.compile: compiled in" in r.getMessage() for r in caplog.records)
    inner = forward._compiled

    def counting(*args):
        calls["compiled"] += 1
        return inner(*args)

    forward._compiled = counting
    got = [compiled.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in _prompts()]
    assert got == expected
    assert calls["compiled"] == 2 * (params.max_tokens - 1)  # every decode step (1 token), no prefill
    calls["compiled"] = 0
    # Two requests decoding together (2-token steps) also run compiled.
    assert [o.outputs[0].token_ids for o in compiled.generate(_prompts(), params, use_tqdm=False)] == together
    assert calls["compiled"] >= params.max_tokens - 1 and not forward.failed


@pytest.mark.slow
def test_what_inductor_cannot_lower_falls_back_to_eager_with_one_warning(tmp_path, default_model_dir, caplog):
    """bfloat16 with oneDNN-packed weights (mkldnn._linear_pointwise on a packed weight): the
    compile fails at start-up, the engine warns once and serves eagerly, token for token."""
    from paged import LLM, SamplingParams

    if not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN is not available: nothing is packed")
    save_tiny_llama(tmp_path, default_model_dir, **INT4_TINY)
    model_dir = str(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    common = dict(device="cpu", dtype="bfloat16", attention="torch", quantization="none", num_kv_blocks=64)
    expected = LLM(model_dir, **common).generate(_prompts(), params, use_tqdm=False)
    with caplog.at_level(logging.WARNING, logger="paged"):
        llm = LLM(model_dir, **common, compile=True)
        got = llm.generate(_prompts(), params, use_tqdm=False)
    assert llm.engine.core.runner.forward_model.failed
    warnings = [r for r in caplog.records if "model.compile" in r.getMessage() and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "running eager" in warnings[0].getMessage()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
