"""Running the app under uvicorn: bind first, then load the model in the background.

Shutdown (SIGINT/SIGTERM): stop accepting, let in-flight requests finish for
``server.shutdown_grace_s``, then end each one still open (a streamed one with an error event and
``[DONE]``, a non-streamed one with a 503), then stop the engine. The same shutdown follows an
engine death (``server.on_engine_death``, see ``paged.core.server.state``), with exit code 1."""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Any, Callable

from paged.core.config import EngineConfig
from paged.core.errors import PagedError
from paged.core.server.app import build_app

logger = logging.getLogger("paged")


def _uvicorn_server_class():
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that SIGINT/SIGTERM end it with a graceful shutdown and exit
        code 0 (uvicorn re-raises the signal afterwards, which would turn SIGINT into a traceback)
        that drains the app's requests first."""

        state = None  # the app's ServerState

        async def shutdown(self, sockets=None) -> None:
            if self.state is not None:
                self.state.begin_shutdown(self.state.config.server.shutdown_grace_s)
            await super().shutdown(sockets)

        @contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server


def run_server(config: EngineConfig, *, access_log: bool = False, log_level: str = "info",
               start_timeout: float = 600.0, make_trace_recorder: Callable[[], Any] | None = None) -> int:
    """Bind ``server.host:server.port`` (before the model loads, so a taken port fails at once),
    start the engine in the background and serve until SIGINT/SIGTERM. Returns an exit code: 0
    after SIGINT/SIGTERM, 1 when the engine failed to start or died (and was not restarted), 2 when
    its engine core found the settings wrong (a ConfigError, as every other command exits)."""
    import socket

    import uvicorn

    host, port = config.server.host, config.server.port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise PagedError(f"server.host/server.port: cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    port = sock.getsockname()[1]
    app = build_app(config, start_timeout=start_timeout, make_trace_recorder=make_trace_recorder)
    # uvicorn cancels what is still running after its own timeout: give the ended requests time
    # to send their last event first (a cancelled handler would log a CancelledError traceback).
    uv_config = uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="on",
                               timeout_graceful_shutdown=config.server.shutdown_grace_s + 10)
    server = _uvicorn_server_class()(uv_config)
    server.state = app.state.paged
    app.state.paged.uvicorn_server = server
    shown = f"[{host}]" if ":" in host else host
    logger.info("listening on http://%s:%d (OpenAI API under /v1)", shown, port)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    state = app.state.paged
    return state.exit_code or (1 if state.start_error else 0)

