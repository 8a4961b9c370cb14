"""`paged serve` end to end: a real server subprocess on a loopback port, driven with the official
`openai` client (and httpx for what the client would not send)."""

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.server import API_KEY, alive, free_port, serve, wait_for
from paged.core.sampling_params import SamplingParams

MAX_TOKENS = 8
MAX_MODEL_LEN = 256
NUM_BLOCKS = 256
PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "The future of AI is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The best way to learn a language is",
    "Water boils at",
    "My favourite colour is",
]
QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "What is 2 + 2?",
             "Say hello in Spanish."]


# --- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    port = free_port()
    tmp = tmp_path_factory.mktemp("server")
    # float32: the tests compare with an offline float32 run token for token (bfloat16 and int4 results
    # depend on the batch a request shares, which differs between the two).
    args = ["--model", default_model_dir, "--device", "cpu", "--dtype", "float32", "--attention", "torch", "--host", "127.0.0.1",
            "--port", str(port), "--api-key", API_KEY, "--num-kv-blocks", str(NUM_BLOCKS),
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "64", "-q",
            "--record-trace", str(tmp / "served.jsonl")]
    with serve(args, tmp, port) as s:
        s.core_pid = s.debug()["core_pid"]
        s.trace_path = tmp / "served.jsonl"
        yield s
        # Clean shutdown on SIGTERM: the server exits 0 and takes its core with it.
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 0, s.log_tail()
        wait_for(lambda: not alive(s.core_pid), 10, "the engine core to exit")


@pytest.fixture(scope="module")
def offline(default_model_dir):
    from paged import LLM

    llm = LLM(default_model_dir, device="cpu", dtype="float32", attention="torch", num_kv_blocks=NUM_BLOCKS,
              max_model_len=MAX_MODEL_LEN)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    completions = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    chats = [o.outputs[0].text for o in llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], greedy,
                                                  use_tqdm=False)]
    return {"completions": dict(zip(PROMPTS, completions)), "chat": dict(zip(QUESTIONS, chats))}


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


# --- end to end ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_health_models_version_auth(server, model_name):
    assert server.get("/health").status_code == 200
    assert server.get("/version").json()["version"]
    assert model_name == Path(server.debug()["model"]["model_dir"]).name
    r = server.get("/v1/models", key=None)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    r = server.get("/v1/models", key="wrong")
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.slow
def test_outputs_equal_offline_greedy(server, client, model_name, offline):
    # Completions, one prompt per request, non-streamed and streamed.
    for prompt in PROMPTS[:2]:
        r = client.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == offline["completions"][prompt]
        assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens >= 1
        chunks = list(client.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == offline["completions"][prompt]
        assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    # Several prompts in one request come back as one choice each, in order.
    r = client.completions.create(model=model_name, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [offline["completions"][p] for p in PROMPTS]
    # Chat, non-streamed and streamed.
    for q in QUESTIONS[:2]:
        messages = [{"role": "user", "content": q}]
        r = client.chat.completions.create(model=model_name, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].message.content == offline["chat"][q]
        assert r.choices[0].message.role == "assistant"
        stream = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=MAX_TOKENS,
                                                temperature=0, stream=True)
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == offline["chat"][q]


@pytest.mark.slow
def test_sampling_options(server, client, model_name, offline):
    prompt = PROMPTS[0]
    # logprobs: the sampled token is the top one under greedy.
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    for token, top in zip(lp.tokens, lp.top_logprobs):
        assert max(top, key=top.get) == token
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                       max_tokens=3, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) >= 1 and all(len(c.top_logprobs) == 3 for c in content)
    # n, seed and the extras (top_k, min_p, ignore_eos) through extra_body.
    extras = {"top_k": 50, "min_p": 0.01, "ignore_eos": True, "priority": 1}
    kw = dict(model=model_name, prompt=prompt, max_tokens=6, temperature=1.0, top_p=0.9, seed=123, n=2,
              presence_penalty=0.1, frequency_penalty=0.1, extra_body=extras)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert sorted(c.index for c in a.choices) == [0, 1] and a.usage.completion_tokens == 12
    # stop strings end the text (not included) with finish_reason "stop".
    full = offline["completions"][prompt]
    stop = full.strip().split()[1]
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert full.startswith(r.choices[0].text)


@pytest.mark.slow
def test_logit_bias_allowed_token_ids_and_bad_words(server, client, model_name, offline, default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)  # the reference for token ids
    prompt = "The capital of France is"
    banana = tok(" banana", add_special_tokens=False)["input_ids"][-1]
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=4, temperature=0,
                                  logit_bias={str(banana): 100})
    assert r.choices[0].text == tok.decode([banana] * 4)  # +100 wins every step
    yes, no = (tok(w, add_special_tokens=False)["input_ids"][-1] for w in (" yes", " no"))
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=6, temperature=1.0, seed=7,
                                  extra_body={"allowed_token_ids": [yes, no]})
    assert set(tok(r.choices[0].text, add_special_tokens=False)["input_ids"]) <= {yes, no}
    # The greedy answer names Paris; with "Paris" a bad word it cannot, in completions or chat.
    assert "Paris" in offline["completions"][prompt]
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in r.choices[0].text and r.choices[0].text != offline["completions"][prompt]
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                       max_tokens=MAX_TOKENS, temperature=0, extra_body={"bad_words": ["Paris"]})
    assert "Paris" in offline["chat"][QUESTIONS[0]] and "Paris" not in r.choices[0].message.content
    # Bad values: a 400 naming the field.
    for body, field in [({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
                        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
                        ({"logit_bias": {"999999999": 1}}, "logit_bias"),
                        ({"allowed_token_ids": [10**9]}, "allowed_token_ids"), ({"allowed_token_ids": []}, "allowed_token_ids"),
                        ({"bad_words": [""]}, "bad_words")]:
        resp = server.post("/v1/completions", {"model": model_name, "prompt": prompt, "max_tokens": 2, **body})
        assert resp.status_code == 400, (body, resp.text)
        assert resp.json()["error"]["message"].startswith(field), resp.json()


@pytest.mark.slow
def test_tokenize_and_detokenize_agree_with_the_tokenizer(server, model_name, default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    text = "Hello, wörld! 12345 <|im_start|>"
    r = server.post("/tokenize", {"model": model_name, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    ids = tok(text)["input_ids"]
    assert r.json() == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                        "token_strs": tok.convert_ids_to_tokens(ids)}
    r = server.post("/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert r["tokens"] == tok(text, add_special_tokens=False)["input_ids"] and r["token_strs"] is None
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTIONS[0]}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    r = server.post("/tokenize", {"model": model_name, "messages": messages}).json()
    assert r["tokens"] == tok(rendered, add_special_tokens=False)["input_ids"]
    r = server.post("/detokenize", {"model": model_name, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": tok.decode(ids)}
    for path, body, field in [("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
                              ("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens"), ("/detokenize", {"tokens": "x"}, "tokens"),
                              ("/tokenize", {"prompt": "a", "model": "other"}, "model")]:
        resp = server.post(path, body)
        assert resp.status_code in (400, 404), (path, body, resp.text)
        assert field in resp.json()["error"]["message"], resp.json()


@pytest.mark.slow
def test_responses_api_runs_as_the_equivalent_chat(server, client, model_name):
    """/v1/responses through the official client; the reference is /v1/chat/completions on the
    messages the Responses request stands for (instructions first, then the stored conversation).
    The requests that do not build on another's answer run at once, in two rounds (the server
    batches them: float32 greedy tokens do not depend on the batch, as the concurrent tests here
    check against the offline engine)."""
    from concurrent.futures import ThreadPoolExecutor

    def chat(messages, **kw):
        return client.chat.completions.create(model=model_name, messages=messages, temperature=0, max_tokens=32,
                                              **kw).choices[0]

    def stream(**kw):
        with client.responses.stream(**kw) as events:
            return list(events)

    system, q1, q2 = "Answer briefly.", QUESTIONS[0], "And of Germany?"
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    with ThreadPoolExecutor(6) as pool:
        # First round: every request that needs no earlier answer.
        f_r1 = pool.submit(client.responses.create, model=model_name, input=q1, instructions=system,
                           max_output_tokens=32, temperature=0)
        f_c1 = pool.submit(chat, [{"role": "system", "content": system}, {"role": "user", "content": q1}])
        f_events = pool.submit(stream, model=model_name, input=q1, instructions=system, max_output_tokens=32,
                               temperature=0)
        f_r3 = pool.submit(client.responses.create, model=model_name, input="What is the weather in Paris?",
                           tools=tools, tool_choice={"type": "function", "name": "get_weather"},
                           max_output_tokens=40, temperature=0)
        f_r5 = pool.submit(client.responses.create, model=model_name, input="Name a city as JSON.",
                           max_output_tokens=40, temperature=0,
                           text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
        f_r6 = pool.submit(client.responses.create, model=model_name, input=q1, store=False, max_output_tokens=2,
                           temperature=0)
        r1, c1 = f_r1.result(), f_c1.result()
        a1, status = c1.message.content, "incomplete" if c1.finish_reason == "length" else "completed"
        assert r1.status == status and r1.output_text == a1 and a1 and r1.usage.output_tokens >= 1
        assert [o.type for o in r1.output] == ["message"] and r1.output[0].content[0].type == "output_text"
        # A forced function call (answered by its output in the next round).
        r3 = f_r3.result()
        (call,) = r3.output
        assert call.type == "function_call" and call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
        # Second round: the requests that continue r1 and r3, with their chat references.
        f_r2 = pool.submit(client.responses.create, model=model_name, input=q2, previous_response_id=r1.id,
                           max_output_tokens=32, temperature=0)  # instructions are not carried over, as OpenAI does it
        f_c2 = pool.submit(chat, [{"role": "user", "content": q1}, {"role": "assistant", "content": a1},
                                  {"role": "user", "content": q2}])
        f_r4 = pool.submit(client.responses.create, model=model_name, previous_response_id=r3.id, tools=tools,
                           max_output_tokens=16, temperature=0,
                           input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}])
        chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools]
        f_c4 = pool.submit(client.chat.completions.create, model=model_name, temperature=0, max_tokens=16,
                           tools=chat_tools, messages=[
                               {"role": "user", "content": "What is the weather in Paris?"},
                               {"role": "assistant", "content": None, "tool_calls": [
                                   {"id": call.call_id, "type": "function",
                                    "function": {"name": call.name, "arguments": call.arguments}}]},
                               {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}])
        assert f_r2.result().output_text == f_c2.result().message.content
        r4, c4 = f_r4.result(), f_c4.result().choices[0]
        events, r5, r6 = f_events.result(), f_r5.result(), f_r6.result()
    assert client.responses.retrieve(r1.id).output_text == a1
    # Streamed: the official events in order, numbered, adding up to the same text.
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == a1
    assert events[-1].response.output[0].content[0].text == a1 and events[-1].response.id == events[0].response.id
    # The function call's output answered in the next turn, as the chat reference answers it.
    assert r4.status == ("incomplete" if c4.finish_reason == "length" else "completed")
    assert r4.output_text == (c4.message.content or "")
    assert [o.name for o in r4.output if o.type == "function_call"] == [t.function.name for t in c4.message.tool_calls or []]
    # text.format: JSON that fits the schema.
    assert set(json.loads(r5.output_text)) == {"city"}
    # store=false: not kept; max_output_tokens: incomplete.
    assert r6.status == "incomplete" and r6.incomplete_details.reason == "max_output_tokens"
    assert server.get(f"/v1/responses/{r6.id}").status_code == 404
    client.responses.delete(r1.id)
    assert server.get(f"/v1/responses/{r1.id}").status_code == 404
    for body, field in [({"input": q1, "background": True}, "background"), ({"input": []}, "input"),
                        ({"input": [{"type": "image", "url": "x"}]}, "input"),
                        ({"input": q1, "tools": [{"type": "web_search"}]}, "tools"),
                        ({"input": q1, "previous_response_id": r6.id}, "previous_response_id"),
                        ({"input": q1, "max_output_tokens": 0}, "max_output_tokens"),
                        ({"input": q1, "text": {"format": {"type": "yaml"}}}, "text.format")]:
        resp = server.post("/v1/responses", {"model": model_name, **body})
        assert resp.status_code == 400, (body, resp.text)
        assert resp.json()["error"]["message"].startswith(field), resp.json()


@pytest.mark.slow
def test_a_streaming_response_can_be_cancelled(server, model_name):
    import threading

    import httpx

    events: list[dict] = []

    def read() -> None:
        with httpx.stream("POST", server.url + "/v1/responses", timeout=120,
                          headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": model_name, "input": "Write a long story about a dragon.",
                                "max_output_tokens": 200, "temperature": 0, "stream": True}) as r:
            events.extend(json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: "))

    reader = threading.Thread(target=read)
    reader.start()
    wait_for(lambda: events or not reader.is_alive(), 120, "the stream to start")
    wait_for(lambda: any(e["type"] == "response.output_text.delta" for e in events) or not reader.is_alive(), 120,
             "the first text")
    response_id = events[0]["response"]["id"]
    r = server.post(f"/v1/responses/{response_id}/cancel", {})
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    reader.join(120)
    assert events[-1]["response"]["status"] == "cancelled"
    assert sum(e["type"] == "response.output_text.delta" for e in events) < 200
    assert server.get(f"/v1/responses/{response_id}").json()["status"] == "cancelled"
    assert server.post(f"/v1/responses/{response_id}/cancel", {}).status_code == 400  # finished now


@pytest.mark.slow
def test_64_concurrent_streaming_clients(server, model_name, offline):
    from openai import AsyncOpenAI

    async def one(client, i: int) -> tuple[str, str]:
        if i % 2 == 0:
            prompt = PROMPTS[i % len(PROMPTS)]
            stream = await client.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True})
            text = "".join([c.choices[0].text async for c in stream if c.choices])
            return text, offline["completions"][prompt]
        q = QUESTIONS[i % len(QUESTIONS)]
        stream = await client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": q}],
                                                      max_tokens=MAX_TOKENS, temperature=0, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        return text, offline["chat"][q]

    async def main():
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=600)
        try:
            return await asyncio.gather(*[one(client, i) for i in range(64)])
        finally:
            await client.close()

    results = asyncio.run(main())
    assert all(got == want for got, want in results), [(g, w) for g, w in results if g != w][:3]
    debug = server.debug(stats=True)
    assert debug["front_end_unfinished_requests"] == 0
    assert debug["core"]["num_free_blocks"] == debug["core"]["num_blocks"] == NUM_BLOCKS


@pytest.mark.slow
def test_disconnected_clients_are_aborted_and_blocks_return(server, model_name):
    import httpx
    from openai import AsyncOpenAI

    finished_label = 'paged:request_success_total{finished_reason="length"}'
    finished_before = server.metrics().get(finished_label, 0.0)

    async def main():
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=600)
        streams = []
        for i in range(4):
            stream = await client.completions.create(model=model_name, prompt=PROMPTS[i], max_tokens=200,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
            streams.append(stream)
        for stream in streams:
            await stream.__anext__()  # a token has arrived: the request is running
        running = server.metrics()
        for stream in streams:
            await stream.close()  # the client goes away mid-stream
        await client.close()
        return running

    running = asyncio.run(main())
    assert running["paged:num_requests_running"] + running["paged:num_requests_waiting"] >= 1
    assert running["paged:num_free_kv_blocks"] < NUM_BLOCKS
    # A non-streamed request whose client goes away is aborted too. The client leaves once the
    # server has generated tokens for it (an event; a client timer would race the 200 tokens).
    def idle():
        m = server.metrics()
        return m["paged:num_requests_running"] == m["paged:num_requests_waiting"] == 0

    wait_for(idle, 60, "the streams aborted")

    async def leave_non_streamed():
        tokens_before = server.metrics()["paged:generation_tokens_total"]
        async with httpx.AsyncClient(timeout=600) as client:
            request = asyncio.create_task(client.post(
                server.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                json={"model": model_name, "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True}))
            while server.metrics()["paged:generation_tokens_total"] <= tokens_before:
                assert not request.done(), "the request finished before the client could leave"
                await asyncio.sleep(0.05)
            request.cancel()  # the connection closes mid-request
            with pytest.raises(asyncio.CancelledError):
                await request

    asyncio.run(leave_non_streamed())

    def all_back():
        m = server.metrics()
        return (m["paged:num_requests_running"] == 0 and m["paged:num_requests_waiting"] == 0
                and m["paged:num_free_kv_blocks"] == m["paged:num_kv_blocks"] == NUM_BLOCKS)

    wait_for(all_back, 60, "every request aborted and every KV block free")
    assert server.debug()["front_end_unfinished_requests"] == 0
    m = server.metrics()
    assert m.get(finished_label, 0.0) == finished_before  # none of the five ran to its 200 tokens
    assert m["paged:generation_tokens_total"] > 0 and m["paged:prompt_tokens_total"] > 0
    assert m["paged:time_to_first_token_seconds_count"] > 0 and m["paged:e2e_request_latency_seconds_count"] > 0
    assert m["paged:inter_token_latency_seconds_count"] > 0 and m["paged:request_queue_time_seconds_count"] > 0
    assert "paged:prefix_cache_queries_total" in m and "paged:prefix_cache_hits_total" in m
    assert "paged:num_preemptions_total" in m and "paged:kv_cache_usage_perc" in m


@pytest.mark.slow
@pytest.mark.parametrize(
    "path,body,param,needle",
    [
        ("/v1/completions", {"prompt": "Hi", "temperature": -1}, "temperature", "temperature"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": "many"}, "max_tokens", "max_tokens"),
        ("/v1/completions", {"prompt": "Hi", "n": 0}, "n", "n:"),
        ("/v1/completions", {"prompt": "Hi", "top_p": 1.5}, "top_p", "top_p"),
        ("/v1/completions", {"prompt": "Hi", "logprobs": 99}, "logprobs", "logprobs"),
        ("/v1/completions", {"prompt": "Hi", "stop": 5}, "stop", "stop"),
        ("/v1/completions", {"prompt": "Hi", "bogus_field": 1}, "bogus_field", "unrecognized"),
        ("/v1/completions", {"prompt": list(range(1000, 1300))}, "prompt", f"max_model_len ({MAX_MODEL_LEN})"),
        ("/v1/completions", {"prompt": "Hi " * 100, "max_tokens": 200}, "prompt", f"max_model_len ({MAX_MODEL_LEN})"),
        ("/v1/completions", {"prompt": [10**9]}, "prompt_token_ids", "out of range"),
        ("/v1/completions", {"max_tokens": 3}, "prompt", "prompt"),
        ("/v1/completions", "{not json", None, "JSON"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages", "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
         "top_logprobs", "top_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": False,
                                  "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ],
)
def test_bad_requests_get_400(server, path, body, param, needle):
    r = server.post(path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert needle in error["message"]


@pytest.mark.slow
def test_server_keeps_serving_after_errors(server, client, model_name, offline):
    from openai import BadRequestError, NotFoundError

    with pytest.raises(BadRequestError) as e:
        client.completions.create(model=model_name, prompt="Hi", max_tokens=MAX_TOKENS, temperature=-1)
    assert e.value.status_code == 400
    with pytest.raises(NotFoundError):
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=2)
    with pytest.raises(BadRequestError):  # streamed requests fail before the stream starts
        client.completions.create(model=model_name, prompt="Hi " * 300, stream=True)
    r = client.completions.create(model=model_name, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == offline["completions"][PROMPTS[1]]
    assert server.get("/health").status_code == 200


@pytest.mark.slow
def test_core_exits_when_front_end_dies(default_model_dir, tmp_path):
    """The core process polls its parent: killing the front-end (SIGKILL, no clean-up) must not
    leave an orphan core."""
    script = (
        "import sys, time\n"
        "from paged.core.config import load_config\n"
        "from paged.core.ipc.client import EngineCoreClient\n"
        f"cfg = load_config(None, {{'model': {{'model': {default_model_dir!r}}}, 'device': 'cpu', "
        "'attention': {'backend': 'torch'}, 'cache': {'num_blocks': 32}})\n"
        "c = EngineCoreClient(cfg)\n"
        "print(c.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        core_pid = int(proc.stdout.readline())
        assert alive(core_pid)
        proc.kill()
        proc.wait()
        wait_for(lambda: not alive(core_pid), 15, "the orphaned core to exit")
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_dead_core_fails_fast_then_the_server_exits(default_model_dir, tmp_path):
    """A deployment from one config file; killing its engine core makes requests fail at once,
    then the server exits non-zero (server.on_engine_death = exit, the default), for its
    supervisor to restart it."""
    from openai import APIError, APITimeoutError, OpenAI

    port = free_port()
    config = tmp_path / "deploy.toml"
    config.write_text(
        f'device = "cpu"\n'
        f'[model]\nmodel = "{default_model_dir}"\nmax_model_len = {MAX_MODEL_LEN}\n'
        f'[cache]\nnum_blocks = 64\n'
        f'[attention]\nbackend = "torch"\n'
        f'[server]\nhost = "127.0.0.1"\nport = {port}\nserved_model_name = "tiny"\n'
    )
    with serve(["--config", str(config), "-q"], tmp_path, port) as s:
        client = OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["tiny"]  # from the file; no key configured
        core_pid = s.debug()["core_pid"]
        stream = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=200, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        os.kill(core_pid, signal.SIGKILL)
        # "Fails fast" without a clock: the open stream ends with the server's error, not the client's
        # 120 s timeout, and before the 200 tokens it asked for.
        received = 1
        with pytest.raises(APIError) as ended:
            for _ in stream:
                received += 1
        assert not isinstance(ended.value, APITimeoutError) and received < 200, (type(ended.value), received)
        assert "died" in str(ended.value), ended.value
        # Then the server drains (nothing is left open) and exits with code 1, on its own.
        assert s.proc.wait(60) == 1, s.log_tail()
        log = s.log.read_text()
        assert f"pid {core_pid}" in log and "the server exits (server.on_engine_death = exit)" in log, log[-3000:]
        assert "Traceback" not in log, log[-3000:]


def test_settings_its_engine_core_refuses_exit_2_naming_the_field(default_model_dir):
    """The API server's front-end loads no plugins (they import torch); its engine core checks the
    policy, the attention backend and their options before any weight loads, and `paged serve`
    exits 2 with the core's message, as `paged run` and `paged config` do."""
    proc = subprocess.run([sys.executable, "-m", "paged.core.cli", "serve", "--model", default_model_dir, "--device", "cpu",
                           "--host", "127.0.0.1", "--port", "0", "--policy", "priority", "--policy-option", "aging_s=-1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "ERROR paged (core): core: start-up failed: ConfigError" in proc.stderr, proc.stderr[-3000:]  # the core checked
    marker = "ERROR paged: the engine failed to start: "
    assert marker in proc.stderr, proc.stderr[-3000:]
    error = proc.stderr.split(marker, 1)[1]
    assert "scheduler.policy_options.aging_s: Input should be greater than or equal to 0" in error, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "loaded LlamaForCausalLM" not in proc.stderr, proc.stderr[-3000:]


def test_served_requests_are_recorded_as_a_lab_trace(server, client, model_name):
    from paged.core.lab.trace import read_trace

    prompt = "Record this request"
    out = client.completions.create(model=model_name, prompt=prompt, max_tokens=3, temperature=0, seed=5)
    assert out.choices[0].finish_reason in ("length", "stop")
    recorded = [r for r in read_trace(server.trace_path).requests if r.prompt == prompt]
    assert recorded, "the finished request is in the trace"
    request = recorded[-1]
    assert request.prompt_token_ids and request.output_len == out.usage.completion_tokens
    assert request.arrival_s >= 0 and request.sampling.get("seed") == 5
