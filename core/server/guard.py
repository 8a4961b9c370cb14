"""What stands between the network and the handlers: the Host check (against DNS rebinding),
API keys, and reading a JSON body (Content-Type, size limit, nesting depth).

With ``server.api_key`` set, every path but /health needs ``Authorization: Bearer <key>``;
/metrics and /debug/engine also take ``server.metrics_api_key``, and ``server.public_metrics``
opens /metrics. The Host header must name the bound address (plus the localhost names on a
loopback address; anything on 0.0.0.0 / ::) unless ``server.allowed_hosts`` says otherwise."""

from __future__ import annotations

import hmac
import ipaddress

import msgspec
from fastapi import Request

from paged.core.config import ServerConfig
from paged.core.server.errors import APIError, invalid

_METRICS_PATHS = ("/metrics", "/debug/engine")


def allowed_host_names(server: ServerConfig) -> set[str] | None:
    """Host names (without port) accepted in the Host header; None = any."""
    if server.allowed_hosts is not None:
        names = {h.lower().strip("[]") for h in server.allowed_hosts}
        return None if "*" in names else names
    host = server.host.lower().strip("[]")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return {host}
    if address.is_unspecified:
        return None
    names = {host}
    if address.is_loopback:
        names |= {"localhost", "127.0.0.1", "::1"}
    return names


def _host_name(header: bytes) -> str:
    host = header.decode("latin-1").strip().lower()
    if host.startswith("["):  # [::1]:8000
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class Guard:
    """A plain ASGI middleware (streamed responses and disconnect detection pass untouched)."""

    def __init__(self, app, server: ServerConfig) -> None:
        self.app = app
        self.hosts = allowed_host_names(server)
        self.key = server.api_key.encode() if server.api_key else None
        self.metrics_key = server.metrics_api_key.encode() if server.metrics_api_key else None
        self.public_metrics = server.public_metrics

    def _authorized(self, path: str, header: bytes) -> bool:
        if self.key is None or path == "/health" or (path == "/metrics" and self.public_metrics):
            return True
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        token = token.strip()
        keys = [self.key] + ([self.metrics_key] if self.metrics_key and path in _METRICS_PATHS else [])
        return any(hmac.compare_digest(token, k) for k in keys)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            error = None
            if self.hosts is not None and _host_name(headers.get(b"host", b"")) not in self.hosts:
                error = APIError(400, "Host header: not a name this server answers to (server.allowed_hosts)",
                                 "invalid_request_error", None, "invalid_host")
            elif not self._authorized(scope["path"], headers.get(b"authorization", b"")):
                error = APIError(401, "Incorrect API key provided. Pass it as `Authorization: Bearer <key>`.",
                                 "invalid_request_error", None, "invalid_api_key")
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def read_json(request: Request, max_bytes: int):
    """The decoded body of a POST: ``application/json`` only, at most ``max_bytes``."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, f"Content-Type: must be application/json (got {media_type or 'none'!r})",
                       "invalid_request_error", "Content-Type", "unsupported_media_type")
    too_large = APIError(413, f"request body: larger than {max_bytes} bytes (server.max_body_bytes)",
                         "invalid_request_error", None, "request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise too_large
    try:
        return msgspec.json.decode(bytes(body))
    except msgspec.DecodeError as e:
        raise invalid(f"request body: invalid JSON ({e})") from None
    except RecursionError:
        raise invalid("request body: nested too deeply") from None
