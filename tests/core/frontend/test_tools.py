"""Tools in chat: validation, the constraint for required / named, prompt rendering, and the
Hermes tool-call parser (whole and streamed in arbitrary pieces)."""

import json

import jsonschema
import pytest

from paged.core.errors import InvalidRequestError
from paged.core.frontend.tools import (
    HermesToolParser, calls_from_constrained, check_tools, render_tool_messages, tool_choice_mode, tool_constraint,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


def test_bad_tools_and_tool_choice_name_the_field():
    for tools, field in [([], "tools"), ([{"type": "function"}], "tools[0]"), ([{"type": "x", "function": {}}], "tools[0]"),
                         ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
                         ([WEATHER, WEATHER], "tools[1].function.name"),
                         ([{"type": "function", "function": {"name": "f", "parameters": 3}}], "tools[0].function.parameters")]:
        with pytest.raises(InvalidRequestError, match=rf"^{field.replace('[', '.').replace(']', '.')}"):
            check_tools(tools)
    with pytest.raises(InvalidRequestError, match=r"tool_choice: unknown function 'nope'"):
        tool_choice_mode({"type": "function", "function": {"name": "nope"}}, [WEATHER])
    with pytest.raises(InvalidRequestError, match="tool_choice: 'required' needs"):
        tool_choice_mode("required", None)
    with pytest.raises(InvalidRequestError, match="tool_choice: must be"):
        tool_choice_mode("sometimes", [WEATHER])
    assert tool_choice_mode(None, [WEATHER]) == ("auto", None) and tool_choice_mode(None, None) == ("none", None)
    assert tool_choice_mode({"type": "function", "function": {"name": "get_time"}}, [WEATHER, TIME]) == ("named", "get_time")


def test_required_constraint_accepts_exactly_valid_calls():
    schema = tool_constraint("required", None, [WEATHER, TIME], parallel=False).json_schema
    jsonschema.validate([{"name": "get_time", "arguments": {"zone": "UTC"}}], schema)
    for bad in ([], [{"name": "get_time", "arguments": {"zone": "PST"}}], [{"name": "other", "arguments": {}}],
                [{"name": "get_time", "arguments": {"zone": "UTC"}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    calls = calls_from_constrained("required", None, '[{"name": "get_time", "arguments": {"zone": "UTC"}}]')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "UTC"})]
    named = tool_constraint("named", "get_weather", [WEATHER, TIME], parallel=True)
    assert named.json_schema == WEATHER["function"]["parameters"]
    assert calls_from_constrained("named", "get_weather", '{"city": "Paris"}')[0].name == "get_weather"


def test_rendering_for_a_template_without_tools():
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    out = render_tool_messages(msgs, [WEATHER], template_renders_tools=False)
    assert out[0]["role"] == "system" and '"get_weather"' in out[0]["content"] and "<tools>" in out[0]["content"]
    assert json.loads(out[2]["content"].split("<tool_call>")[1].split("</tool_call>")[0]) == {
        "name": "get_weather", "arguments": {"city": "Paris"}}
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    passed = render_tool_messages(msgs, [WEATHER], template_renders_tools=True)
    assert passed[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"} and passed[2] == msgs[2]


TEXT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call> done')


def test_hermes_parser_whole_and_streamed_in_any_pieces():
    content, calls = HermesToolParser.parse(TEXT)
    assert content == "Let me check.  done"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    assert len({c.id for c in calls}) == 2
    for size in (1, 2, 3, 7, 11):
        parser, streamed, got = HermesToolParser(), "", []
        for i in range(0, len(TEXT), size):
            text, new = parser.feed(TEXT[i : i + size])
            assert "<" not in text or "<tool_call>" not in streamed + text
            streamed += text
            got += new
        tail, more = parser.finish()
        assert streamed + tail == "Let me check.  done"
        assert [(c.name, c.arguments) for c in got + more] == [(c.name, c.arguments) for c in calls]
    # not a call: text stays content; an unclosed but complete call at the end is taken
    assert HermesToolParser.parse("a < b <tool") == ("a < b <tool", [])
    content, calls = HermesToolParser.parse('<tool_call>{"name": "f", "arguments": {}}')
    assert content == "" and calls[0].name == "f"


def test_smollm2_template_gets_tools_in_a_hermes_system_message(default_model_dir):
    from paged.core.frontend.processor import InputProcessor
    from paged.core.loading.loader import load_tokenizer

    processor = InputProcessor(load_tokenizer(default_model_dir), None)
    assert processor.template_renders_tools() is False  # SmolLM2's template ignores tools
    prompt = processor.apply_chat_template([{"role": "user", "content": "Weather in Paris?"}], [WEATHER])
    assert prompt.startswith("<|im_start|>system\nYou may call one or more functions")
    assert '"name": "get_weather"' in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert "You may call" not in processor.apply_chat_template([{"role": "user", "content": "Hi"}])


WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.mark.slow
def test_llm_chat_with_tools_returns_calls_that_validate(default_model_dir):
    """LLM.chat(tools=, tool_choice=) as on the server: required and named calls are constrained,
    parsed into tool_calls and validate against the tool's parameters; "none" shows no tools."""
    import jsonschema

    from paged import LLM, SamplingParams
    from paged.core.errors import InvalidRequestError

    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    params = SamplingParams(max_tokens=100, temperature=0)
    with LLM(default_model_dir, device="cpu", num_kv_blocks=64) as llm:
        required = llm.chat(messages, params, tools=WEATHER_TOOLS, tool_choice="required", use_tqdm=False)
        named = llm.chat(messages, params, tools=WEATHER_TOOLS, use_tqdm=False,
                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
        none = llm.chat(messages, params, tools=WEATHER_TOOLS, tool_choice="none", use_tqdm=False)
        plain = llm.chat(messages, params, use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="tool_choice: unknown function 'nope'"):
            llm.chat(messages, params, tools=WEATHER_TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    for out in (required[0].outputs[0], named[0].outputs[0]):
        assert out.finish_reason == "stop", out
        assert [call.name for call in out.tool_calls] == ["get_weather"], out.text
        jsonschema.validate(json.loads(out.tool_calls[0].arguments), WEATHER_TOOLS[0]["function"]["parameters"])
    assert none[0].outputs[0].tool_calls is None and plain[0].outputs[0].tool_calls is None
    assert none[0].prompt == plain[0].prompt and "get_weather" in required[0].prompt


MISTRAL_OUTPUTS = [  # output text -> (content, [(name, arguments as an object)]), by hand
    ('Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     ("Sure.", [("get_weather", {"city": "Paris"})])),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}',
     ("", [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})])),
    ("No tools needed [TOOL_CALL", ("No tools needed [TOOL_CALL", [])),
    ('[TOOL_CALLS][{"name": "get_weather", "argum', ('[TOOL_CALLS][{"name": "get_weather", "argum', [])),
]


@pytest.mark.parametrize("text, expected", MISTRAL_OUTPUTS)
def test_mistral_parser_both_formats_whole_and_streamed(text, expected):
    from paged.core.frontend.tools import TOOL_PARSERS, MistralToolParser

    assert TOOL_PARSERS["mistral"] is TOOL_PARSERS["mixtral"] is MistralToolParser
    content, calls = MistralToolParser.parse(text)
    assert (content, [(c.name, json.loads(c.arguments)) for c in calls]) == expected
    for size in (1, 2, 5, len(text)):
        parser, streamed, streamed_calls = MistralToolParser(), "", []
        for at in range(0, len(text), size):
            piece, more = parser.feed(text[at:at + size])
            streamed, streamed_calls = streamed + piece, streamed_calls + more
        piece, more = parser.finish()
        assert (streamed + piece).strip() == content and [c.name for c in streamed_calls + more] == \
            [name for name, _ in expected[1]]
