"""Greedy token ids identical to HF transformers on the default model, under every mechanism
that changes how the batch is computed: prefix caching on/off, chunked prefill, preemption and
recompute, and both bundled policies."""

import pytest

from paged import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
    "List three primary colors:",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Once upon a time, in a small village at the edge of a dark forest, there lived",
    "Q: What is 12 times 12?\nA:",
    "Translate to French: Good morning, how are you today?",
    "import numpy as np\nx = np.arange(10)\nprint(",
    "The three laws of thermodynamics are",
]

MAX_NEW = 24

pytestmark = pytest.mark.slow

CASES = {
    "prefix-caching-on": dict(enable_prefix_caching=True),
    "prefix-caching-off": dict(enable_prefix_caching=False),
    "every-prompt-chunked": dict(max_num_batched_tokens=8, long_prefill_token_threshold=5),
    "preempted-and-recomputed": dict(num_kv_blocks=9, block_size=8, max_num_seqs=8),
    "priority": dict(policy="priority", policy_options={"aging_s": 0}),
}


@pytest.mark.parametrize("case", CASES)
def test_greedy_ids_equal_hf(case, default_model_dir, hf_greedy):
    llm = LLM(default_model_dir, device="cpu", dtype="float32", attention="torch", **CASES[case])  # exact HF float32 parity
    tokenizer = llm.tokenizer
    prompts = list(PROMPTS)
    # Shared prefixes so the prefix cache has something to hit.
    prompts += [PROMPTS[5] + " a dragon", PROMPTS[5] + " an old baker"]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)  # both stop at EOS
    priority = [i % 3 for i in range(len(prompts))] if case == "priority" else None
    outputs = llm.generate(prompts, params, priority=priority, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        got = output.outputs[0].token_ids
        assert got == hf_greedy(tokenizer(prompt)["input_ids"], MAX_NEW, candidate=got), prompt
    stats = llm.engine.core.snapshot_stats()
    if case == "preempted-and-recomputed":
        assert stats.num_preemptions > 0
    if case == "prefix-caching-on":
        assert llm.engine.kv_cache_manager.prefix_cache_stats.hits > 0
    if case == "prefix-caching-off":
        assert llm.engine.kv_cache_manager.prefix_cache_stats.hits == 0
    # Every block is back once everything finished.
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.kv_cache_manager.num_blocks


def test_the_teacher_forced_reference_is_what_hf_generate_gives(default_model_dir, hf_greedy):
    """The reference above checks a candidate in one forward (conftest ``hf_greedy``): on HF's own
    greedy tokens it gives them back; a candidate wrong at position 3 gets HF's tokens up to and
    including that position; a short right one is extended by generation."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    for prompt in (PROMPTS[4], PROMPTS[6]):
        ids = tokenizer(prompt)["input_ids"]
        generated = hf_greedy(ids, 13)[:12]  # (each max_new_tokens is its own cache entry)
        assert len(generated) == 12
        assert hf_greedy(ids, 12, candidate=generated) == generated
        wrong = generated[:3] + [(generated[3] + 1) % len(tokenizer)] + generated[4:]
        assert hf_greedy(ids, 11, candidate=wrong) == generated[:4]
        assert hf_greedy(ids, 10, candidate=generated[:5]) == generated[:10]
