"""The msgspec messages between the front-end and the engine core process."""

import pytest

from paged.core.sampling_params import SamplingParams


def test_msgspec_messages_round_trip():
    from paged.core.engine.model_info import ModelInfo
    from paged.core.engine.outputs import EngineCoreOutput, EngineCoreRequest
    from paged.core.ipc.messages import (
        AbortRequests, AddRequests, CoreFailed, Outputs, Ready, RequestFailed, UtilityCall, UtilityResult,
        make_encoder, message_decoder, request_decoder,
    )
    from paged.core.engine.request import Request
    from paged.core.engine.sampler import TokenLogprobs

    enc = make_encoder()
    params = SamplingParams(n=1, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, seed=11, max_tokens=9,
                            stop=["\n", "END"], stop_token_ids=[7], logprobs=2, presence_penalty=0.5,
                            frequency_penalty=-0.5, ignore_eos=True)
    # What the front-end's InputProcessor builds and sends as is.
    add = EngineCoreRequest("r-1#0", [1, 2, 3], params, 12.5, priority=-3, cache_salt="s", eos_token_id=2,
                            max_tokens=9, tenant="t", deadline=20.0)
    second = EngineCoreRequest("r-1#1", [1, 2, 3], params, 12.5, eos_token_id=2, max_tokens=9)
    inputs = [add, AddRequests([add, second]), AbortRequests(["a", "b"], "stop"), UtilityCall(4, "stats", [1, "x"])]
    for msg in inputs:
        payload = enc.encode(msg)
        assert isinstance(payload, bytes)
        assert request_decoder().decode(payload) == msg
    # The core builds its Request from the decoded message.
    back = request_decoder().decode(enc.encode(add)).to_request()
    assert isinstance(back, Request)
    for name in ("request_id", "prompt_token_ids", "sampling_params", "arrival_time", "priority", "cache_salt",
                 "eos_token_id", "max_tokens", "tenant", "deadline"):
        assert getattr(back, name) == getattr(add, name), name
    assert back.all_token_ids == [1, 2, 3] and back.all_token_ids is not add.prompt_token_ids  # it grows

    out = EngineCoreOutput("r-1#0", [42], finish_reason="stop", stop_token_id=42,
                           logprobs=[TokenLogprobs(42, -0.25, 1, [(42, -0.25), (7, -1.5)])], arrival_time=1.0,
                           first_scheduled_time=1.5, first_token_time=2.0, finished_time=3.0, num_cached_tokens=16,
                           num_preemptions=1)
    plain = EngineCoreOutput("r-2", [5, 6])
    info = ModelInfo("/models/x", 2048, 49152, [2, 3], 100, 16)
    messages = [Ready(info, 1234), Outputs([out, plain], 99.5),
                UtilityResult(4, {"num_free_blocks": 3}), UtilityResult(5, None, "boom"),
                RequestFailed("r-3", "prompt: too long"), CoreFailed("CUDA error")]
    for msg in messages:
        assert message_decoder().decode(enc.encode(msg)) == msg
    decoded = message_decoder().decode(enc.encode(messages[1]))
    assert decoded.outputs == [out, plain]  # the engine's own output type, unchanged by the wire
    # A message of the wrong direction, or garbage, is a decode error, not an arbitrary object.
    import msgspec

    with pytest.raises(msgspec.DecodeError):
        request_decoder().decode(enc.encode(messages[0]))
    with pytest.raises(msgspec.DecodeError):
        message_decoder().decode(b"\x80\x04not-msgpack")
