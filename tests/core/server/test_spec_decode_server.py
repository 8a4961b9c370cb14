"""Speculative decoding through the CLIs: ``paged serve --speculative-config`` streams several
tokens per event and reports the spec_decode counters on /metrics; ``paged run`` reports them in
its summary. Both give HF transformers' greedy tokens on the default model's weights (float32)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from helpers.server import API_KEY, free_port, serve

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
PROMPT = "apple, banana, cherry, apple, banana, cherry, apple, banana, cherry, apple,"


@pytest.mark.slow
def test_served_stream_and_paged_run_give_hf_tokens_with_several_per_event(default_model_dir, hf_greedy, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    ids = tokenizer(PROMPT)["input_ids"]
    port = free_port()
    args = ["--model", default_model_dir, "--device", "cpu", "--dtype", "float32", "--attention", "torch",
            "--port", str(port), "--api-key", API_KEY, "--speculative-config", SPEC, "-q"]
    with serve(args, tmp_path, port) as server:
        body = {"model": default_model_dir, "prompt": ids, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "stream": True, "logprobs": 0}
        chunks = []
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        choices = [c["choices"][0] for c in chunks if c["choices"]]
        streamed_text = "".join(c["text"] for c in choices)
        per_event = [len(c["logprobs"]["tokens"]) for c in choices if c.get("logprobs")]
        assert sum(per_event) == 40 and max(per_event) > 1  # accepted drafts arrive together
        metrics = server.metrics()
        assert metrics["paged:spec_decode_num_draft_tokens_total"] >= metrics["paged:spec_decode_num_accepted_tokens_total"] > 0
        assert metrics["paged:spec_decode_num_drafts_total"] > 0

    run = subprocess.run([sys.executable, "-m", "paged.core.cli", "run", "--model", default_model_dir, "--device", "cpu",
                          "--dtype", "float32", "--attention", "torch", "--speculative-config", SPEC,
                          "--max-tokens", "40", "--ignore-eos", "--json", "-q", PROMPT],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(run.stdout)
    got = doc["requests"][0]["token_ids"]
    want = hf_greedy(ids, 40, candidate=got)
    assert got == want
    assert streamed_text == tokenizer.decode(want)
    spec = doc["summary"]["speculative"]
    assert spec["method"] == "ngram" and spec["num_accepted_tokens"] > 0
    assert spec["mean_accepted_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"], abs=1e-3)
