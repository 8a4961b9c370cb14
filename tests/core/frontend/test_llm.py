"""The offline API and `paged run` on the default model: outputs, sampling features end to end,
bad input, and the CLI's text / JSON / prompts-file modes."""

import json
import os
import subprocess
import sys

import pytest

from paged import LLM, SamplingParams
from paged.core.errors import InvalidRequestError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(default_model_dir, device="cpu", dtype="float32", attention="torch", max_num_seqs=16, num_kv_blocks=400)


def test_chat_answers_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert "Paris" in completion.text
    assert completion.finish_reason == "stop"  # the model ends its turn with <|im_end|> (EOS)
    assert completion.token_ids[-1] in llm.engine.model_info.eos_token_ids
    m = completion.metrics
    assert m.time_to_first_token > 0 and m.decode_time >= 0 and m.e2e_latency >= m.time_to_first_token


def test_outputs_carry_text_ids_reason_and_logprobs(llm):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    out = llm.generate("The capital of France is", params, use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 6
    assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert len(c.logprobs) == 6
    for token, lp in zip(c.token_ids, c.logprobs):
        assert lp.token_id == token and lp.rank == 1  # greedy picks the top token
        assert len(lp.top) == 3 and lp.top[0][0] == token and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_seed_reproducible_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["Tell me a story."], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True)
    batch = llm.generate(["Hello", "Tell me a story.", "Why is the sky blue?"], [others, seeded, others],
                         use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone


def test_n_samples_share_prompt_blocks(llm):
    kv = llm.engine.kv_cache_manager
    before = kv.prefix_cache_stats.hits
    prompt = "Write a long poem about the mountains and the rivers and the sea, in the style of an old ballad:"
    n_prompt = len(llm.tokenizer(prompt)["input_ids"])
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different seeds per sample
    full_blocks = (n_prompt - 1) // kv.block_size
    assert kv.prefix_cache_stats.hits - before >= 2 * full_blocks * kv.block_size


def test_stop_string_is_cut_and_request_ends(llm):
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = llm.generate("Count: 1, 2, 3, 4,", greedy, use_tqdm=False)[0].outputs[0].text
    assert " 7" in full
    stopped = llm.generate("Count: 1, 2, 3, 4,", greedy.copy(stop=[" 7"]), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == " 7"
    assert stopped.text == full[: full.index(" 7")]


def test_bad_requests_are_rejected_and_others_go_on(llm):
    engine = llm.engine
    engine.add_request("ok", "Hello", SamplingParams(temperature=0, max_tokens=3))
    with pytest.raises(InvalidRequestError, match=r"exceeds max_model_len \(8192\)"):
        engine.add_request("long", [1] * 8190, SamplingParams(max_tokens=10))
    with pytest.raises(InvalidRequestError, match=r"prompt_token_ids: \[999999\] out of range"):
        engine.add_request("bad-id", [1, 999999], SamplingParams())
    with pytest.raises(InvalidRequestError, match="temperature: invalid value -1"):
        SamplingParams(temperature=-1)
    with pytest.raises(InvalidRequestError, match="can never fit in the KV cache"):
        engine.add_request("huge", [1] * 100, SamplingParams(max_tokens=8000))
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    assert set(done) == {"ok"} and len(done["ok"].outputs[0].token_ids) == 3
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks


def test_abort_frees_blocks(llm):
    engine = llm.engine
    engine.add_request("a", "The history of Rome", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.kv_cache_manager.num_free_blocks < engine.kv_cache_manager.num_blocks
    engine.abort_request("a")
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks


def _run(args, stdin=None):
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "paged.core.cli", "run", "-q", *args], capture_output=True,
                          text=True, input=stdin, env=env, timeout=600)


def test_paged_run_cli_json_prompts_file_and_stdin(default_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "The capital of France is", "max_tokens": 4, "priority": 1}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12})
        + "\n"
    )
    proc = _run(["--model", default_model_dir, "--prompts-file", str(prompts), "--json", "--policy=priority"])
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    first, second = doc["requests"]
    assert first["prompt"] == "The capital of France is" and len(first["token_ids"]) == 4
    assert first["finish_reason"] == "length" and "Paris" in second["text"]
    summary = doc["summary"]
    assert summary["requests"] == 2 and summary["output_tokens"] == len(first["token_ids"]) + len(second["token_ids"])
    for key in ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "prefix_cache_hit_rate", "preemptions", "peak_kv_usage"):
        assert key in summary
    text = _run(["--model", default_model_dir, "--max-tokens", "3"], stdin="Hello\nGoodbye\n")
    assert text.returncode == 0, text.stderr
    assert text.stdout.count("--- ") == 2 and "output_tokens: 6" in text.stderr
    bad = _run(["--model", default_model_dir, "--temperature", "-2", "Hi"])
    assert bad.returncode == 2 and "temperature: invalid value -2.0" in bad.stderr
