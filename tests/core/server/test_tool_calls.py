"""The server's structured-output and tool-call shaping, without a server: request fields to a
constraint (400s naming the client's field), final messages and streamed deltas per tool_choice."""

import json

import pytest

from paged.core.frontend.outputs import CompletionOutput
from paged.core.frontend.tools import HermesToolParser
from paged.core.server.errors import APIError
from paged.core.server.protocol import ChatCompletionRequest, ChatMessage
from paged.core.server.structured import structured_output_of
from paged.core.server.tool_calls import ToolCallShaper


def _req(**kw):
    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **kw)


def test_request_fields_become_one_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert structured_output_of(_req(), rf).json_schema == schema
    assert structured_output_of(_req(), {"type": "json_object"}).json_object is True
    assert structured_output_of(_req(), {"type": "text"}) is None
    assert structured_output_of(_req(structured_outputs={"regex": "a+"})).regex == "a+"
    assert structured_output_of(_req(guided_choice=["x", "y"])).choice == ["x", "y"]
    assert structured_output_of(_req(guided_json=json.dumps(schema))).json_schema == schema
    for kw, rf, param in [({"guided_regex": "a", "guided_choice": ["b"]}, None, "guided_regex"),
                          ({}, {"type": "xml"}, "response_format"),
                          ({"structured_outputs": {"yaml": 1}}, None, "structured_outputs"),
                          ({"guided_choice": []}, None, "guided_choice")]:
        with pytest.raises(APIError) as e:
            structured_output_of(_req(**kw), rf)
        assert e.value.status == 400 and e.value.param == param


def _outputs(pieces, finish="stop"):
    text = ""
    for k, piece in enumerate(pieces):
        text += piece
        yield CompletionOutput(0, text=text, new_text=piece, finish_reason=finish if k == len(pieces) - 1 else None)


def _collect(shaper, pieces):
    content, calls, finish = "", {}, None
    for out in _outputs(pieces):
        delta, reason = shaper.delta(0, out)
        content += delta.get("content", "")
        for tc in delta.get("tool_calls", []):
            entry = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            entry["id"] = tc.get("id") or entry["id"]
            entry["name"] = tc.get("function", {}).get("name") or entry["name"]
            entry["arguments"] += tc.get("function", {}).get("arguments", "")
        finish = reason or finish
    return content, calls, finish


def test_named_required_and_auto_messages_and_deltas():
    named = ToolCallShaper("named", "f", HermesToolParser)
    msg, reason = named.message(CompletionOutput(0, text='{"x": 1}', finish_reason="stop"))
    assert reason == "tool_calls" and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    content, calls, finish = _collect(ToolCallShaper("named", "f", HermesToolParser), ['{"x"', ': 1', "}"])
    assert finish == "tool_calls" and calls[0]["name"] == "f" and json.loads(calls[0]["arguments"]) == {"x": 1}

    text = '[{"name": "g", "arguments": {"y": "z"}}, {"name": "f", "arguments": {}}]'
    msg, reason = ToolCallShaper("required", None, HermesToolParser).message(CompletionOutput(0, text=text, finish_reason="stop"))
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["g", "f"] and reason == "tool_calls"
    content, calls, finish = _collect(ToolCallShaper("required", None, HermesToolParser), [text[:9], text[9:]])
    assert [calls[i]["name"] for i in sorted(calls)] == ["g", "f"] and finish == "tool_calls"

    text = 'Sure. <tool_call>{"name": "f", "arguments": {"q": 2}}</tool_call>'
    msg, reason = ToolCallShaper("auto", None, HermesToolParser).message(CompletionOutput(0, text=text, finish_reason="stop"))
    assert msg["content"] == "Sure." and msg["tool_calls"][0]["function"]["arguments"] == '{"q": 2}'
    content, calls, finish = _collect(ToolCallShaper("auto", None, HermesToolParser), [text[i:i + 5] for i in range(0, len(text), 5)])
    assert content.strip() == "Sure." and calls[0]["name"] == "f" and finish == "tool_calls"
    # no call: plain content, plain finish reason; cut short by max_tokens: length, no calls
    msg, reason = ToolCallShaper("auto", None, HermesToolParser).message(CompletionOutput(0, text="Hi", finish_reason="stop"))
    assert msg == {"role": "assistant", "content": "Hi"} and reason == "stop"
    msg, reason = ToolCallShaper("named", "f", HermesToolParser).message(CompletionOutput(0, text='{"x": ', finish_reason="length"))
    assert "tool_calls" not in msg and reason == "length"


def _tool(parameters=...):
    function = {"name": "f"} if parameters is ... else {"name": "f", "parameters": parameters}
    return {"type": "function", "function": function}


@pytest.mark.parametrize("parameters", ['{"type": "object"}', {"type": "string"}, {"properties": {"a": {}}}, [], 3])
def test_tool_parameters_must_be_an_object_schema(parameters):
    from paged.core.errors import InvalidRequestError
    from paged.core.frontend.tools import check_tools
    from paged.core.server.errors import from_exception

    with pytest.raises(InvalidRequestError) as e:
        check_tools([_tool({"type": "object"}), {"type": "function", "function": {"name": "g", "parameters": parameters}}])
    error = from_exception(e.value)
    assert error.status == 400 and error.param == "tools[1].function.parameters", error.message
    assert "type 'object'" in error.message and repr(parameters)[:20] in error.message


@pytest.mark.parametrize("parameters", [..., {}, {"type": "object"}, {"type": "object", "properties": {"a": {"type": "integer"}}}])
def test_tool_parameters_object_schemas_are_accepted(parameters):
    from paged.core.frontend.tools import check_tools

    assert check_tools([_tool(parameters)])


def test_tool_message_needs_tool_call_id():
    from paged.core.server.chat import chat_messages

    messages = [ChatMessage(role="user", content="Weather?"), ChatMessage(role="tool", content="sunny")]
    with pytest.raises(APIError) as e:
        chat_messages(messages)
    assert e.value.status == 400 and e.value.param == "messages[1].tool_call_id"
    assert "role 'tool'" in e.value.message
    messages[1] = ChatMessage(role="tool", content="sunny", tool_call_id="call_1")
    assert chat_messages(messages)[1] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_tenant_header_is_checked_under_its_own_name():
    from paged.core.server.protocol import tenant_header

    assert tenant_header("team-a") == "team-a" and tenant_header(None) is None
    with pytest.raises(APIError) as e:
        tenant_header("t" * 300)
    assert e.value.status == 400 and e.value.param == "X-Paged-Tenant"
    assert e.value.message.startswith("X-Paged-Tenant:") and "300" in e.value.message and "256" in e.value.message
    assert "user" not in e.value.message


@pytest.mark.parametrize("parameters", [..., {}])
def test_a_tool_without_parameters_is_called_with_no_arguments(parameters):
    import jsonschema

    from paged.core.frontend.tools import tool_constraint

    named = tool_constraint("named", "f", [_tool(parameters)], parallel=True).json_schema
    jsonschema.validate({}, named)
    with pytest.raises(jsonschema.ValidationError):  # it used to allow any object, which a small model rambles on in
        jsonschema.validate({"type": "object"}, named)
