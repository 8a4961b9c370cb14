"""What the server's handlers share: the engine (once started), its metrics and the served name."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from paged.core.config import EngineConfig
from paged.core.frontend.async_llm import AsyncLLM
from paged.core.server.errors import APIError, ShuttingDown, engine_unavailable, shutting_down
from paged.core.server.inputs import PromptInputs
from paged.core.server.metrics import Metrics
from paged.core.server.streaming import Tokens


class ServerState:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.llm: AsyncLLM | None = None
        self.start_error: str | None = None
        self.metrics = Metrics()
        self.cancel_start = threading.Event()
        self.served_model_name: str | None = config.server.served_model_name
        self.created = int(time.time())
        self.uvicorn_server = None  # set by run_server, to stop when the engine cannot start
        self.tokens: Tokens | None = None
        self.inputs: PromptInputs | None = None
        self.draining = False  # SIGTERM came: new requests get 503, open ones may finish
        self.open_merges: set[asyncio.Queue] = set()  # one per request being answered

    def begin_shutdown(self, grace_s: float) -> None:
        """Refuse new requests; after ``grace_s`` end the open ones (error event, then [DONE])."""
        self.draining = True

        def end_open_requests() -> None:
            for queue in list(self.open_merges):
                queue.put_nowait((-1, ShuttingDown()))

        asyncio.get_running_loop().call_later(grace_s, end_open_requests)

    def require_llm(self) -> AsyncLLM:
        if self.draining:
            raise shutting_down()
        llm = self.llm
        if llm is None:
            raise engine_unavailable(self.start_error or "the engine is starting; retry when /health returns 200")
        if not llm.is_alive:
            raise engine_unavailable(llm._dead or llm.client.death_message())
        return llm

    def check_model(self, model: str | None) -> None:
        if model is None:
            return
        accepted = {self.served_model_name, self.config.model.model}
        if self.llm is not None:
            accepted.add(self.llm.model_info.model_dir)
        if model not in accepted:
            raise APIError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model",
                           "model_not_found")


def default_served_model_name(config: EngineConfig) -> str:
    if config.server.served_model_name:
        return config.server.served_model_name
    if config.model.model is None:  # the embedded default: its name, not its cache directory's
        from paged.core.loading.gguf import DEFAULT_GGUF

        return DEFAULT_GGUF.split(".")[0]
    path = Path(config.model.model)
    return path.stem if path.suffix == ".gguf" else path.name
