"""The messages between a front-end and its engine-core process(es) (ZeroMQ + msgspec msgpack;
nothing is ever pickled). The protocol, the sockets and the process lifecycle are described in
``paged.core.ipc.engine_core_proc``.

Front-end -> core (``CoreRequest``, a tagged union): ``AddRequest`` (the engine's own
``EngineCoreRequest``, built by the front-end's InputProcessor and sent as is), ``AddRequests``
(several at once: the samples of one request, the inputs of one embeddings call, so that the
core's next step sees all of them rather than the first alone), ``AbortRequests``,
``UtilityCall`` (``stats``, ``reset_prefix_cache``, ``ping``, ``add_lora``, ...) and ``Refused`` (the
answer to a READY the front-end does not take).
Core -> front-end (``CoreMessage``): ``Ready`` (once, over the DEALER, after the model and the KV
cache are up), ``Outputs`` (one per engine step that produced something; the engine's own
``EngineCoreOutput``), ``UtilityResult``, ``RequestFailed`` (the core rejected an added request),
``CoreFailed`` (a fatal error; the core exits right after), ``Heartbeat`` (with cores on other
nodes).
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from paged.core.engine.model_info import ModelInfo
from paged.core.engine.outputs import EngineCoreOutput, EngineCoreRequest
from paged.core.errors import EngineError


class EngineDeadError(EngineError):
    """The engine core process is not running (it died, or it has not started)."""


# --- messages ------------------------------------------------------------------------------------
# The "add" message is the engine's own EngineCoreRequest, sent as the front-end built it.
AddRequest = EngineCoreRequest


class AddRequests(msgspec.Struct, tag="add_many", array_like=True):
    requests: list[EngineCoreRequest]


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]
    status: str = "abort"  # "abort" (client went away) | "stop" (a stop string ended it)


class UtilityCall(msgspec.Struct, tag="utility", array_like=True):
    call_id: int
    method: str
    args: list[Any] = []


class Heartbeat(msgspec.Struct, tag="beat", array_like=True):
    """Core -> front-end every ``parallel.data_parallel_heartbeat_s``, over tcp: the core of
    ``dp_rank`` is alive (a core knows the front-end is alive from its connection: libzmq's ZMTP
    heartbeats)."""

    dp_rank: int = -1


class Refused(msgspec.Struct, tag="refused", array_like=True):
    """Front-end -> core, after its READY: the front-end does not take this core (its fingerprint
    differs, or its rank is served already); the core logs ``reason`` and exits."""

    reason: str


CoreRequest = Union[AddRequest, AddRequests, AbortRequests, UtilityCall, Refused]


class Ready(msgspec.Struct, tag="ready", array_like=True):
    model_info: ModelInfo
    pid: int
    dp_rank: int = 0
    host: str = ""  # the core's machine (its hostname), for logs and per-core metrics
    # what must match between the cores of one engine (paged.core.ipc.fingerprint): the front-end
    # refuses a core whose fingerprint differs from rank 0's
    fingerprint: str = ""


class Outputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[EngineCoreOutput]
    timestamp: float  # time.monotonic() in the core when the step ended (same clock in every process)


class UtilityResult(msgspec.Struct, tag="utility_result", array_like=True):
    call_id: int
    result: Any = None
    error: str | None = None


class RequestFailed(msgspec.Struct, tag="failed", array_like=True):
    request_id: str
    message: str
    invalid: bool = True  # an InvalidRequestError (the client's fault) rather than an internal error
    http_status: int = 0  # 429 / 503: the policy's admission control rejected it (RequestRejectedError)


class CoreFailed(msgspec.Struct, tag="dead", array_like=True):
    message: str
    dp_rank: int = 0
    config_error: bool = False  # a ConfigError at start-up: the settings are wrong (``message`` names the field)


CoreMessage = Union[Ready, Outputs, UtilityResult, RequestFailed, CoreFailed, Heartbeat]


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, tuple):
        return list(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def make_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def request_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreRequest)


def message_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreMessage)
