"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

400 for an invalid request (paged's InvalidRequestError messages name the field first, ``field:
...``, which becomes ``param``), 401 for a missing or wrong API key, 404 for an unknown model, 503
while the engine core is not running, 500 for anything unexpected (still in this shape)."""

from __future__ import annotations

import re
from typing import Any

from fastapi.responses import JSONResponse

from paged.core.errors import InvalidRequestError, PagedError, RequestRejectedError
from paged.core.ipc.messages import EngineDeadError


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


class ShuttingDown(Exception):
    """Ends every open request stream when the shutdown grace period is over."""


_PARAM = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*)(?::| \()")


def invalid(message: str, param: str | None = None) -> APIError:
    """A 400 whose ``param`` is taken from the message's leading ``field:`` unless given."""
    if param is None:
        m = _PARAM.match(message)
        param = m.group(1) if m else None
    return APIError(400, message, "invalid_request_error", param, "invalid_value" if param else None)


def engine_unavailable(message: str) -> APIError:
    return APIError(503, message, "server_error", None, "engine_unavailable")


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry on another replica or later", "server_error", None,
                    "server_shutting_down")


def rejected(reason: str, http_status: int = 503) -> APIError:
    """A request the scheduling policy turned away: 429 (the client should slow down) or 503."""
    if http_status == 429:
        return APIError(429, reason, "requests", None, "rate_limit_exceeded")
    return APIError(503, reason, "server_error", None, "rejected_by_policy")


def rejection(outputs) -> APIError | None:
    """The error for a request the policy turned away from the queue (it finished with
    finish_reason "rejected" before producing anything, the reason in stop_reason), or that a
    plugin failed on (finish_reason "error": a 500 naming the plugin), else None."""
    for out in outputs:
        for c in out.outputs:
            if c.finish_reason == "rejected":
                return rejected(str(c.stop_reason or "rejected by the scheduling policy"))
            if c.finish_reason == "error":
                return APIError(500, str(c.stop_reason or "the engine failed on this request"), "server_error", None,
                                "engine_error")
    return None


def from_exception(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidRequestError):
        return invalid(str(e))
    if isinstance(e, EngineDeadError):
        return engine_unavailable(str(e))
    if isinstance(e, ShuttingDown):
        return shutting_down()
    if isinstance(e, RecursionError):
        return invalid("request body: nested too deeply")
    if isinstance(e, RequestRejectedError):  # the scheduling policy's admission control
        return rejected(str(e), e.http_status)
    if isinstance(e, PagedError):
        return APIError(500, str(e), "server_error")
    return APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error")
