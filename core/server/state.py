"""What the server's handlers share: the engine (once started), its metrics and the served name."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from paged.core.config import EngineConfig
from paged.core.frontend.async_llm import AsyncLLM
from paged.core.server.errors import APIError, engine_unavailable
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

    def require_llm(self) -> AsyncLLM:
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
