"""Prompt logprobs (``SamplingParams.prompt_logprobs``) against HF transformers' own logits on the
default model's weights (float32): every prompt token's logprob, rank and top-k, under chunked
prefill, a prefix cache that holds the prompt already, preemption and recompute, and n > 1."""

from __future__ import annotations

import pytest
import torch

from paged import LLM, SamplingParams
from paged.core.errors import InvalidRequestError

PROMPTS = [
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old baker who",
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "A",  # one token: nothing to score
]
K = 3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_logprobs(default_model_dir):
    """Prompt token ids -> HF's log_softmax over the vocabulary at every position, [P, vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)

    return logprobs


def assert_like_hf(prompt_ids: list[int], entries: list, hf: torch.Tensor, k: int = K) -> None:
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for j in range(1, len(prompt_ids)):
        e, row, token = entries[j], hf[j - 1], prompt_ids[j]
        assert e.token_id == token
        assert e.logprob == pytest.approx(row[token].item(), abs=2e-4), j
        # the rank counts tokens clearly more likely (ties within float32 noise either way)
        assert int((row > row[token] + 1e-4).sum()) + 1 <= e.rank <= int((row > row[token] - 1e-4).sum()) + 1, j
        assert len(e.top) == k
        if not k:
            continue
        want_top = row.topk(k)
        assert e.top[0][0] == want_top.indices[0].item(), j
        for (t, v) in e.top:
            assert v == pytest.approx(row[t].item(), abs=2e-4)
        assert [v for _, v in e.top] == sorted((v for _, v in e.top), reverse=True)
        assert e.top[-1][1] == pytest.approx(want_top.values[-1].item(), abs=2e-4)


def test_chunked_prefill_and_a_cached_prefix_give_hf_logprobs(default_model_dir, hf_logprobs):
    llm = LLM(default_model_dir, device="cpu", dtype="float32", attention="torch", enable_prefix_caching=True,
              max_num_batched_tokens=16, block_size=8)
    tokenizer = llm.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=K)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        ids = tokenizer(prompt)["input_ids"]
        assert out.prompt_token_ids == ids
        assert_like_hf(ids, out.prompt_logprobs, hf_logprobs(ids))
    # The first prompt's blocks are cached now: a plain request hits them, one that asks for
    # prompt logprobs computes every position again and gets all of them.
    kv = llm.engine.kv_cache_manager
    hits = kv.prefix_cache_stats.hits
    plain = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert kv.prefix_cache_stats.hits > hits and plain.prompt_logprobs is None
    again = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0),
                         use_tqdm=False)[0]
    ids = tokenizer(PROMPTS[0])["input_ids"]
    assert_like_hf(ids, again.prompt_logprobs, hf_logprobs(ids), k=0)
    assert all(e.top == [] for e in again.prompt_logprobs[1:])
    assert again.outputs[0].token_ids == outputs[0].outputs[0].token_ids
    # n samples: the prompt's logprobs once, for the request
    two = llm.generate([PROMPTS[1]], SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=3, prompt_logprobs=1),
                       use_tqdm=False)[0]
    ids = tokenizer(PROMPTS[1])["input_ids"]
    assert len(two.outputs) == 2
    assert_like_hf(ids, two.prompt_logprobs, hf_logprobs(ids), k=1)
    assert kv.num_free_blocks == kv.num_blocks
    # the generate runner refuses pooling requests (embeddings need --runner pooling)
    with pytest.raises(InvalidRequestError, match="model.runner: this engine generates"):
        llm.embed(["hi"], use_tqdm=False)


def test_preempted_requests_get_each_prompt_logprob_once(default_model_dir, hf_logprobs):
    # 9 blocks of 8 tokens for 6 requests of ~20-40 tokens: they preempt each other, some mid-prefill
    llm = LLM(default_model_dir, device="cpu", dtype="float32", attention="torch", num_kv_blocks=9, block_size=8,
              max_num_seqs=6, max_num_batched_tokens=16)
    prompts = PROMPTS[:3] + [p + " and then" for p in PROMPTS[:3]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=K),
                           use_tqdm=False)
    assert llm.engine.core.snapshot_stats().num_preemptions > 0
    for prompt, out in zip(prompts, outputs):
        ids = llm.tokenizer(prompt)["input_ids"]
        assert_like_hf(ids, out.prompt_logprobs, hf_logprobs(ids))


def test_bad_prompt_logprobs_name_the_field():
    for bad in (21, -1, 1.5, True):
        with pytest.raises(InvalidRequestError, match=r"prompt_logprobs: invalid value .*\[0, 20\]|prompt_logprobs: .*integer"):
            SamplingParams(prompt_logprobs=bad)
