"""Prompt logprobs through ``paged serve`` with the official client: ``echo`` with ``logprobs``
(lm-eval-harness' loglikelihood call: ``max_tokens`` 0), streamed echo, vLLM's
``prompt_logprobs`` extra in completions and chat, and the errors. Values against HF
transformers' logits on the default model's weights (float32)."""

from __future__ import annotations

import openai
import pytest
import torch

from helpers.server import API_KEY, serve_default_model

pytestmark = pytest.mark.slow
PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    with serve_default_model(default_model_dir, tmp_path_factory.mktemp("srv"), "--served-model-name", "m") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)


@pytest.fixture(scope="module")
def hf(default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()

    def logprobs(ids):
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)

    return tokenizer, logprobs


def test_echo_with_max_tokens_0_gives_the_prompts_loglikelihood(client, hf):
    tokenizer, logprobs = hf
    ids = tokenizer(PROMPT)["input_ids"]
    want = logprobs(ids)
    r = client.completions.create(model="m", prompt=PROMPT, echo=True, logprobs=2, max_tokens=0, temperature=0)
    choice = r.choices[0]
    assert choice.text == PROMPT and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, len(ids)):
        assert lp.token_logprobs[j] == pytest.approx(want[j - 1, ids[j]].item(), abs=2e-4)
        best = int(want[j - 1].argmax())
        assert lp.top_logprobs[j][tokenizer.decode([best])] == pytest.approx(want[j - 1, best].item(), abs=2e-4)
    assert lp.text_offset == [len(tokenizer.decode(ids[:j])) for j in range(len(ids))]
    total = sum(lp.token_logprobs[1:])
    assert total == pytest.approx(sum(want[j - 1, ids[j]].item() for j in range(1, len(ids))), abs=2e-3)


def test_echo_with_generation_streamed_and_not(client, hf):
    tokenizer, logprobs = hf
    ids = tokenizer(PROMPT)["input_ids"]
    full = client.completions.create(model="m", prompt=ids, echo=True, logprobs=0, max_tokens=5, temperature=0)
    text = full.choices[0].text
    assert text.startswith(tokenizer.decode(ids)) and len(text) > len(tokenizer.decode(ids))
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 5 and lp.token_logprobs[0] is None
    assert lp.token_logprobs[len(ids)] == pytest.approx(logprobs(ids)[-1].max().item(), abs=2e-4)  # greedy: the best
    stream = client.completions.create(model="m", prompt=ids, echo=True, logprobs=0, max_tokens=5, temperature=0,
                                       stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == text
    assert chunks[0].text.startswith(tokenizer.decode(ids))
    streamed = sum((c.logprobs.token_logprobs for c in chunks if c.logprobs), [])
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


def test_vllm_prompt_logprobs_extra_in_completions_and_chat(client, hf):
    tokenizer, logprobs = hf
    ids = tokenizer(PROMPT)["input_ids"]
    want = logprobs(ids)
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 1})
    entries = r.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for j in range(1, len(ids)):
        own = entries[j][str(ids[j])]
        assert own["logprob"] == pytest.approx(want[j - 1, ids[j]].item(), abs=2e-4)
        assert own["decoded_token"] == tokenizer.decode([ids[j]]) and own["rank"] >= 1
        best = int(want[j - 1].argmax())
        assert entries[j][str(best)]["rank"] == 1
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          temperature=0, extra_body={"prompt_logprobs": 0})
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                             add_generation_prompt=True)
    chat_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    entries = chat.model_extra["prompt_logprobs"]
    assert len(entries) == len(chat_ids) and entries[0] is None
    want = logprobs(chat_ids)
    assert [entries[j][str(chat_ids[j])]["logprob"] for j in range(1, len(chat_ids))] == pytest.approx(
        [want[j - 1, chat_ids[j]].item() for j in range(1, len(chat_ids))], abs=2e-4)


@pytest.mark.parametrize("body, field", [
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
])
def test_bad_prompt_logprobs_requests_are_400s_naming_the_field(server, body, field):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = server.post(path, {"model": "m", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(field), r.text
    assert server.post("/v1/completions", {"model": "m", "prompt": "ok", "max_tokens": 1}).status_code == 200
