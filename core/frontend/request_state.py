"""What the asynchronous front-end keeps per request: its output stream (``RequestStream``), its
record (``FrontRequest``), and the observer that turns request events into metrics."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from paged.core.frontend.outputs import RequestOutput

if TYPE_CHECKING:
    from paged.core.frontend.async_llm import AsyncLLM


class StatsObserver:
    """Receives per-request measurements (the server turns them into Prometheus metrics).
    Times are seconds. Every method is optional to override."""

    def prompt_tokens(self, n: int) -> None: ...
    def generation_tokens(self, n: int) -> None: ...
    def time_to_first_token(self, s: float) -> None: ...
    def inter_token_latency(self, s: float) -> None: ...
    def e2e_latency(self, s: float) -> None: ...
    def queue_time(self, s: float) -> None: ...
    def request_finished(self, finish_reason: str) -> None: ...


class RequestStream:
    """The outputs of one request, in order. Iterate it; ``close()`` aborts it if unfinished."""

    def __init__(self, llm: "AsyncLLM", request_id: str) -> None:
        self.request_id = request_id
        self._llm = llm
        self._queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def _put(self, item: RequestOutput | BaseException | None) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is None:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._llm.abort(self.request_id)


@dataclass(eq=False)
class FrontRequest:
    """Everything the front-end keeps for one request and its n children, dropped in one place
    (``AsyncLLM._forget``); the output processor's ParentRequest holds the text side."""

    request_id: str
    stream: RequestStream
    child_ids: list[str]
    live_child_ids: set[str] = field(default_factory=set)  # not finished in the core yet
    last_token_time: dict[str, float] = field(default_factory=dict)  # child id -> its last token's arrival
    counted_finished: set[int] = field(default_factory=set)  # sample indexes the observer has counted
