"""Sliding-window attention end to end through ``paged.LLM``: a tiny random Qwen2 whose every
layer slides (window 8, prompts of 19-33 tokens), chunked prefill and prefix caching on, greedy
tokens identical to HF transformers float32 over 32 tokens; the KV manager frees the blocks out
of the window, so a decoding request holds at most ``window / block_size + 2`` blocks."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers

from paged import LLM, SamplingParams
from paged.core.engine.kv_cache_manager import PLACEHOLDER_BLOCK

WINDOW, BLOCK_SIZE, NEW_TOKENS = 8, 4, 32

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sliding_qwen2(tmp_path_factory, default_model_dir):
    config = transformers.Qwen2Config(
        vocab_size=49152, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    config.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # large enough that the tokens vary (and differ from full attention's)
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    path = tmp_path_factory.mktemp("sliding-qwen2") / "model"
    hf.save_pretrained(path)
    for f in Path(default_model_dir).iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, path / f.name)
    return hf, path


def test_greedy_tokens_match_hf_with_blocks_freed_behind_the_window(sliding_qwen2):
    hf, path = sliding_qwen2
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(100, 4000, (24,), generator=gen).tolist()
    prompts = [torch.randint(100, 4000, (n,), generator=gen).tolist() for n in (19, 33)]
    prompts += [shared + [7, 8, 9], shared + [11, 12, 13, 14, 15]]  # prefix-cache hits on `shared`
    llm = LLM(str(path), device="cpu", dtype="float32", attention="torch", block_size=BLOCK_SIZE,
              enable_prefix_caching=True, max_num_batched_tokens=16, long_prefill_token_threshold=8,
              num_kv_blocks=64)
    kv = llm.engine.kv_cache_manager
    assert kv.sliding_window == WINDOW  # every layer slides
    held: list[tuple[int, int, int]] = []  # (computed tokens, prompt tokens, real blocks held)

    def observe(output):
        for s in output.scheduled:
            r = s.request
            blocks = sum(1 for b in kv.block_tables.get(r.request_id, ()) if b is not PLACEHOLDER_BLOCK)
            held.append((s.num_computed_tokens, r.num_prompt_tokens, blocks))

    llm.engine.core.schedule_observers.append(observe)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    # the first two together; the shared-prefix pair after them, so the second one hits the first's blocks
    outputs = llm.generate(prompts[:3], params, use_tqdm=False) + llm.generate(prompts[3:], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                               do_sample=False, pad_token_id=2)[0, len(prompt):].tolist()
        assert output.outputs[0].token_ids == want
        assert len(set(want)) > NEW_TOKENS // 2  # not a degenerate repetition
    assert kv.prefix_cache_stats.hits > 0
    decoding = [blocks for computed, prompt, blocks in held if computed >= prompt]
    assert decoding and max(decoding) <= WINDOW // BLOCK_SIZE + 2  # not the 65 / 4 of a full context
    assert max(blocks for _, _, blocks in held) < (33 + NEW_TOKENS) // BLOCK_SIZE
    assert kv.num_free_blocks == kv.num_blocks
    llm.shutdown()


def test_a_request_longer_than_the_cache_runs_when_its_window_and_one_chunk_fit(sliding_qwen2):
    """Every layer slides, so a request needs only its window and one step of blocks: with window
    8, blocks of 4 and a 16-token budget, a step from position p reads p - 7 .. p + 15 (23
    positions), at most cdiv(23, 4) + 1 = 7 blocks. A 33 + 32 = 65-token request (17 blocks) runs
    in a 7-block cache, greedy-identical to HF; with 6 blocks it is refused up front."""
    from paged.core.engine.scheduler import blocks_needed_alone
    from paged.core.errors import InvalidRequestError

    assert blocks_needed_alone(65, BLOCK_SIZE, WINDOW, 16) == 7
    assert blocks_needed_alone(65, BLOCK_SIZE, None, 16) == 17 == blocks_needed_alone(65, BLOCK_SIZE, WINDOW, 0)
    assert blocks_needed_alone(10, BLOCK_SIZE, WINDOW, 16) == 3  # a short request: all its blocks
    hf, path = sliding_qwen2
    prompt = torch.randint(100, 4000, (33,), generator=torch.Generator().manual_seed(9)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                           do_sample=False, pad_token_id=2)[0, len(prompt):].tolist()
    for num_blocks in (7, 6):
        llm = LLM(str(path), device="cpu", dtype="float32", attention="torch", block_size=BLOCK_SIZE,
                  enable_prefix_caching=True, max_num_batched_tokens=16, num_kv_blocks=num_blocks)
        try:
            assert llm.engine.kv_cache_manager.num_blocks == num_blocks
            if num_blocks == 7:
                [output] = llm.generate([prompt], params, use_tqdm=False)
                assert output.outputs[0].token_ids == want
            else:
                with pytest.raises(InvalidRequestError, match=r"8-token sliding window and a 16-token chunk need 7 "
                                                              r"blocks.*raise cache.kv_cache_memory_gib"):
                    llm.generate([prompt], params, use_tqdm=False)
        finally:
            llm.shutdown()
