"""Qwen3's thinking block in chat completions: ``reasoning_content`` apart from ``content``, final
and streamed; ``chat_template_kwargs`` (``enable_thinking``) reaches the template, as in vLLM.

The served model is a tiny random Qwen3 with the default model's tokenizer and a chat template
written here the way Qwen3's behaves (``enable_thinking=False`` writes an empty block into the
prompt). Its output is forced by a regex, so the expected split is known by hand."""

import json
import shutil
from pathlib import Path

import pytest

from helpers.server import API_KEY, free_port, serve
from paged.core.errors import InvalidRequestError
from paged.core.frontend.processor import check_chat_template_kwargs
from paged.core.frontend.reasoning import ThinkParser, reasoning_parser_for, starts_in_reasoning

QWEN3_LIKE_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{%- endif %}"
)

# (output text, prompt left a block open) -> (reasoning_content, content), worked out by hand
SPLITS = [
    ("<think>\nLet me add.\n</think>\n\n4", False, ("Let me add.\n", "4")),
    ("Let me add.</think>\n\n4", True, ("Let me add.", "4")),
    ("4, plainly", False, (None, "4, plainly")),
    ("<think>\nstill thinking when max_tokens ran out", False, ("still thinking when max_tokens ran out", "")),
    ("<thin", False, (None, "<thin")),  # not the tag after all
    ("<think>\n\n</think>\n\nHi", False, ("", "Hi")),
    ("Hi </think> there", False, (None, "Hi </think> there")),  # no block opened: all content
]


@pytest.mark.parametrize("text, in_reasoning, expected", SPLITS)
def test_split_and_every_streamed_chunking_agree_with_the_hand_split(text, in_reasoning, expected):
    assert ThinkParser.split(text, in_reasoning) == expected
    for size in range(1, len(text) + 1):
        parser = ThinkParser(in_reasoning)
        reasoning = content = ""
        for at in range(0, len(text), size):
            r, c = parser.feed(text[at:at + size])
            reasoning, content = reasoning + r, content + c
        r, c = parser.finish()
        assert ((reasoning + r) if parser.opened else None, content + c) == expected, size


def test_which_prompts_leave_a_block_open_and_which_models_think():
    assert starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not starts_in_reasoning("<|im_start|>assistant\n")
    assert reasoning_parser_for("auto", "qwen3") == reasoning_parser_for("auto", "qwen3_moe") == "qwen3"
    assert reasoning_parser_for("auto", "llama") is None and reasoning_parser_for("none", "qwen3") is None
    assert reasoning_parser_for("qwen3", "llama") == "qwen3"


def test_chat_template_kwargs_are_checked():
    assert check_chat_template_kwargs(None) == {}
    assert check_chat_template_kwargs({"enable_thinking": False}) == {"enable_thinking": False}
    with pytest.raises(InvalidRequestError, match=r"chat_template_kwargs: 'tokenize' is set by the server"):
        check_chat_template_kwargs({"tokenize": True})
    with pytest.raises(InvalidRequestError, match=r"chat_template_kwargs: must be an object"):
        check_chat_template_kwargs(["enable_thinking"])


@pytest.fixture(scope="module")
def qwen3_server(default_model_dir, tmp_path_factory):
    import torch
    import transformers

    path = tmp_path_factory.mktemp("qwen3-thinking")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1,
                                      eos_token_id=2)
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    for f in Path(default_model_dir).iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, path / f.name)
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = QWEN3_LIKE_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    yield from _serve_model(path)


def _serve_model(path: Path):
    """A float32 server of the model in ``path`` named "m" (``model_dir``: the path)."""
    port = free_port()
    args = ["--model", str(path), "--device", "cpu", "--dtype", "float32", "--attention", "torch", "--host",
            "127.0.0.1", "--port", str(port), "--api-key", API_KEY, "--num-kv-blocks", "64", "--served-model-name", "m", "-q"]
    with serve(args, path, port) as server:
        server.model_dir = path
        yield server


def _chat(server, **body):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    body = {"model": "m", "messages": messages, "temperature": 0, "max_tokens": 40,
            "structured_outputs": {"regex": r"<think>\n[a-z]{3,8}\n</think>\n\n[a-z]{2,6}"}, **body}
    return server.post("/v1/chat/completions", body)


def test_served_qwen3_splits_reasoning_final_and_streamed(qwen3_server):
    reply = _chat(qwen3_server)
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    reasoning, content = message["reasoning_content"], message["content"]
    assert reasoning.endswith("\n") and reasoning[:-1].isalpha() and 3 <= len(reasoning) - 1 <= 8
    assert content.isalpha() and 2 <= len(content) <= 6 and "<think>" not in content

    stream = _chat(qwen3_server, stream=True)
    assert stream.status_code == 200, stream.text
    streamed = {"reasoning_content": "", "content": ""}
    for line in stream.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                for key in streamed:
                    streamed[key] += choice["delta"].get(key) or ""
    assert streamed == {"reasoning_content": reasoning, "content": content}


def test_enable_thinking_reaches_the_template(qwen3_server):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen3_server.model_dir)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    for kwargs in ({}, {"enable_thinking": False}):
        want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        want = want["input_ids"] if hasattr(want, "keys") else want
        got = qwen3_server.post("/tokenize", {"messages": messages, "chat_template_kwargs": kwargs or None})
        assert got.status_code == 200, got.text
        assert got.json()["tokens"] == list(want), kwargs
    # Without thinking, the prompt holds the empty block: the completion is all content.
    reply = _chat(qwen3_server, chat_template_kwargs={"enable_thinking": False},
                  structured_outputs={"regex": r"[a-z]{2,6}"})
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    assert message["content"].isalpha() and "reasoning_content" not in message
    assert reply.json()["usage"]["prompt_tokens"] > _chat(qwen3_server).json()["usage"]["prompt_tokens"]

    bad = _chat(qwen3_server, chat_template_kwargs={"add_generation_prompt": False})
    assert bad.status_code == 400 and "chat_template_kwargs" in bad.json()["error"]["message"], bad.text


# Qwen3-Thinking-2507's way: the generation prompt leaves the block open, so the output starts
# inside it and is reasoning until "</think>" (the random model never writes it: all reasoning).
ALWAYS_THINKING_TEMPLATE = QWEN3_LIKE_TEMPLATE.replace(
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}", "<think>\n")


@pytest.fixture(scope="module")
def thinking_server(qwen3_server, tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-always-thinking")
    for f in Path(qwen3_server.model_dir).iterdir():
        if f.is_file():
            shutil.copy(f, path / f.name)
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = ALWAYS_THINKING_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    yield from _serve_model(path)


def test_responses_put_the_thinking_in_a_reasoning_item_final_and_streamed(thinking_server):
    """Through the official client, whose types parse every event and item. The reference is chat
    completions' reasoning_content for the same messages (greedy float32: the same tokens), and
    reasoning_tokens is the reasoning text as HF's tokenizer encodes it."""
    from openai import OpenAI
    from transformers import AutoTokenizer

    client = OpenAI(base_url=thinking_server.url + "/v1", api_key=API_KEY)
    question, n = "What is 2 + 2?", 12
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}], temperature=0,
                                          max_tokens=n)
    want = chat.choices[0].message.model_extra["reasoning_content"]
    assert want and chat.choices[0].finish_reason == "length"

    response = client.responses.create(model="m", input=question, temperature=0, max_output_tokens=n)
    assert response.status == "incomplete" and response.output_text == ""
    [item] = response.output  # all reasoning: no message item for an empty text
    assert item.type == "reasoning" and item.summary == [] and item.status == "incomplete"
    assert [(c.type, c.text) for c in item.content] == [("reasoning_text", want)]
    tokenizer = AutoTokenizer.from_pretrained(thinking_server.model_dir)
    details = response.usage.output_tokens_details
    assert details.reasoning_tokens == len(tokenizer.encode(want, add_special_tokens=False)) > 0
    assert response.usage.output_tokens == n

    with client.responses.stream(model="m", input=question, temperature=0, max_output_tokens=n) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    added = kinds.index("response.output_item.added")
    assert events[added].item.type == "reasoning" and events[added].item.content == []
    deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert deltas and all(e.item_id == events[added].item.id and e.output_index == 0 for e in deltas)
    assert added < kinds.index("response.reasoning_text.delta") < kinds.index("response.reasoning_text.done") \
        < kinds.index("response.output_item.done") < kinds.index("response.incomplete")
    assert "".join(e.delta for e in deltas) == want
    [done] = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == want
    final = events[-1].response
    assert [(i.type, i.id, i.content[0].text) for i in final.output] == [("reasoning", events[added].item.id, want)]
    assert "response.output_text.delta" not in kinds


def test_a_json_constraint_makes_the_output_content_though_the_prompt_left_a_block_open(thinking_server):
    """json_schema / json_object constrain from the first token: the output is the JSON, not the
    thinking the prompt opened (chat and Responses alike)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    reply = thinking_server.post("/v1/responses", {
        "model": "m", "input": "What is 2 + 2?", "temperature": 0, "max_output_tokens": 40,
        "text": {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}})
    assert reply.status_code == 200, reply.text
    output = reply.json()["output"]
    assert [item["type"] for item in output] == ["message"], output
    assert isinstance(json.loads(output[0]["content"][0]["text"])["n"], int)
    assert reply.json()["usage"]["output_tokens_details"]["reasoning_tokens"] == 0

    chat = thinking_server.post("/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": "What is 2 + 2?"}], "temperature": 0,
        "max_tokens": 40, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
    assert chat.status_code == 200, chat.text
    message = chat.json()["choices"][0]["message"]
    assert "reasoning_content" not in message and isinstance(json.loads(message["content"])["n"], int)
