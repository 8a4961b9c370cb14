"""Output plumbing shared by the generation endpoints: token text and logprob formatting,
server-sent events, reading several request streams as one, and cancelling on client disconnect."""

from __future__ import annotations

import asyncio
from contextlib import suppress
from typing import Any, AsyncIterator

import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from paged.core.frontend.outputs import RequestOutput
from paged.core.frontend.stream import MergedStreams
from paged.core.server.errors import APIError, from_exception


class Tokens:
    """Token id -> text, cached."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self.cache[token_id] = text
        return text


def completion_logprobs(tok: Tokens, logprobs: list, text_offset: int) -> dict[str, Any]:
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in logprobs:
        s = tok(lp.token_id)
        tokens.append(s)
        token_lps.append(lp.logprob)
        top = {tok(t): v for t, v in lp.top}
        top.setdefault(s, lp.logprob)
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def echoed_prompt_logprobs(tok: Tokens, prompt_token_ids: list[int], entries: list | None) -> dict[str, Any]:
    """The legacy completions ``logprobs`` of an echoed prompt: its first token has none
    (``null``); ``entries`` (``RequestOutput.prompt_logprobs``) None when not asked for."""
    tokens = [tok(t) for t in prompt_token_ids]
    offsets, at = [], 0
    for s in tokens:
        offsets.append(at)
        at += len(s)
    token_lps: list[float | None] = [None] * len(tokens)
    tops: list[dict[str, float] | None] = [None] * len(tokens)
    for j, e in enumerate(entries or ()):
        if e is not None:
            token_lps[j] = e.logprob
            top = {tok(t): v for t, v in e.top}
            top.setdefault(tokens[j], e.logprob)
            tops[j] = top
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_json(tok: Tokens, entries: list | None) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}} holding the prompt's own token and the top-k."""
    if entries is None:
        return None
    out: list[dict[str, Any] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        item = {str(t): {"logprob": v, "rank": r + 1, "decoded_token": tok(t)} for r, (t, v) in enumerate(e.top)}
        item[str(e.token_id)] = {"logprob": e.logprob, "rank": e.rank, "decoded_token": tok(e.token_id)}
        out.append(item)
    return out


def chat_logprobs(tok: Tokens, logprobs: list) -> dict[str, Any]:
    content = []
    for lp in logprobs:
        s = tok(lp.token_id)
        content.append({
            "token": s, "logprob": lp.logprob, "bytes": list(s.encode("utf-8")),
            "top_logprobs": [{"token": tok(t), "logprob": v, "bytes": list(tok(t).encode("utf-8"))} for t, v in lp.top],
        })
    return {"content": content}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(data: Any) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


DONE = b"data: [DONE]\n\n"


async def merged(streams: list, open_merges: set | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several request streams as they come, read through one queue
    (``MergedStreams``); closes them all on exit. While it runs, its MergedStreams is in
    ``open_merges``: ``interrupt(ShuttingDown())`` there ends it."""
    merge = MergedStreams(streams)
    if open_merges is not None:
        open_merges.add(merge)
    try:
        async for item in merge:
            yield item
    finally:
        if open_merges is not None:
            open_merges.discard(merge)
        merge.close()


class EventStream(StreamingResponse):
    """A StreamingResponse that always watches for the client going away and then cancels the
    body (whatever ASGI spec version the server speaks), so the request is aborted at once."""

    async def __call__(self, scope, receive, send) -> None:
        async def stream() -> None:
            with suppress(OSError):
                await self.stream_response(send)

        sender = asyncio.ensure_future(stream())
        watcher = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({sender, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (sender, watcher):
                t.cancel()
            await asyncio.gather(sender, watcher, return_exceptions=True)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with suppress(Exception):
                    await aclose()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, coro) -> Response:
    """Run the handler; if the client disconnects first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if task.cancelled() or not task.done():
        with suppress(BaseException):
            await task
        return Response(status_code=499)
    return task.result()



async def first_or_error(it) -> Any:
    """The first item of a merged stream, or an error Response (before any header is sent)."""
    try:
        return await anext(it)
    except StopAsyncIteration:
        return APIError(500, "the request produced no output", "server_error").response()
    except Exception as e:
        await it.aclose()
        return from_exception(e).response()
