"""Where the asynchronous front-end hands a request's outputs to its consumer: a
``RequestStream`` per request, or several read as one (``MergedStreams``, one queue for them all:
no task or second queue per request).

What goes in (``RequestStream.put``): the request's outputs in order (as its output kind says),
then nothing more once one is ``finished``; an exception, which ends it with that error; or
None, which ends it without one (the request was aborted or forgotten)."""

from __future__ import annotations

import asyncio
from typing import Callable

from paged.core.frontend.outputs import RequestOutput


class RequestStream:
    """The outputs of one request, in order. Iterate it; ``close()`` aborts the request if its
    end has not been read. ``finished``: its last item was read (or it was closed)."""

    def __init__(self, request_id: str, abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._abort = abort
        self._queue: asyncio.Queue = asyncio.Queue()
        self._key: int | None = None  # set once joined to a MergedStreams: items go there as (key, item)
        self.finished = False

    def put(self, item: RequestOutput | BaseException | None) -> None:
        """The producer's side (the front-end's output handler); never blocks."""
        if self._key is None:
            self._queue.put_nowait(item)
        else:
            self._queue.put_nowait((self._key, item))

    def _read(self, item: RequestOutput | BaseException | None) -> RequestOutput:
        """The consumer's side of one item: the output, or the end (StopAsyncIteration or the
        error raised)."""
        if item is None:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def _join(self, queue: asyncio.Queue, key: int) -> None:
        """Put (key, item) into ``queue`` from now on; what is queued here moves there first."""
        own = self._queue
        while not own.empty():
            queue.put_nowait((key, own.get_nowait()))
        self._queue, self._key = queue, key

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self._key is not None:  # a joined stream is read through its MergedStreams
            raise StopAsyncIteration
        return self._read(await self._queue.get())

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)


class MergedStreams:
    """Several request streams read as one: ``(index in streams, output)`` as they come, until
    every stream has ended; an error in any of them (or one passed to ``interrupt``) is raised.
    ``close()`` closes them all (aborting the unfinished ones)."""

    def __init__(self, streams: list[RequestStream]) -> None:
        self.streams = streams
        self._queue: asyncio.Queue = asyncio.Queue()
        for index, stream in enumerate(streams):
            stream._join(self._queue, index)
        self._open = sum(not s.finished for s in streams)

    def interrupt(self, error: BaseException) -> None:
        """End the reading with ``error`` (e.g. the server's shutdown grace period is over)."""
        self._queue.put_nowait((-1, error))

    def __aiter__(self) -> "MergedStreams":
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        while self._open:
            index, item = await self._queue.get()
            if index < 0:
                raise item
            stream = self.streams[index]
            if stream.finished:
                continue  # e.g. the None that follows an error
            try:
                output = stream._read(item)
            except StopAsyncIteration:
                self._open -= 1
                continue
            except BaseException:
                self._open -= 1
                raise
            if stream.finished:
                self._open -= 1
            return index, output
        raise StopAsyncIteration

    def close(self) -> None:
        for stream in self.streams:
            stream.close()
