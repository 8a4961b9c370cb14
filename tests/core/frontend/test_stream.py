"""Request streams and several of them read as one (the server's multi-prompt responses): one
queue, no task per stream; each stream ends on its finished output, an error or None."""

from __future__ import annotations

import asyncio

import pytest

from paged.core.frontend.outputs import CompletionOutput, RequestOutput
from paged.core.frontend.stream import MergedStreams, RequestStream


def _out(rid: str, text: str, finished: bool = False) -> RequestOutput:
    c = CompletionOutput(0, text, [1], "length" if finished else None, new_text=text, new_token_ids=[1])
    return RequestOutput(rid, None, [1], [c], finished=finished)


def test_a_stream_yields_until_its_finished_output_and_close_aborts_only_an_open_one():
    async def main():
        aborted = []
        stream = RequestStream("a", aborted.append)
        stream.put(_out("a", "x"))
        stream.put(_out("a", "y", finished=True))
        assert [o.outputs[0].text async for o in stream] == ["x", "y"]
        stream.close()
        other = RequestStream("b", aborted.append)
        other.put(_out("b", "x"))
        assert (await other.__anext__()).outputs[0].text == "x"
        other.close()
        assert aborted == ["b"]

    asyncio.run(main())


def test_merged_streams_read_through_one_queue_in_arrival_order():
    async def main():
        aborted = []
        a, b = RequestStream("a", aborted.append), RequestStream("b", aborted.append)
        a.put(_out("a", "a1"))  # queued before the merge: moved over, in order
        merge = MergedStreams([a, b])
        b.put(_out("b", "b1"))
        a.put(_out("a", "a2", finished=True))
        b.put(None)  # b ended without an output (aborted)
        got = [(i, o.outputs[0].text) async for i, o in merge]
        assert got == [(0, "a1"), (1, "b1"), (0, "a2")]
        assert a.finished and b.finished
        merge.close()
        assert aborted == []  # both had ended: nothing to abort

    asyncio.run(main())


def test_an_error_in_one_stream_or_an_interrupt_ends_the_merge():
    async def main():
        aborted = []
        a, b = RequestStream("a", aborted.append), RequestStream("b", aborted.append)
        merge = MergedStreams([a, b])
        a.put(ValueError("core rejected it"))
        a.put(None)  # what abort() puts after the error: skipped
        with pytest.raises(ValueError, match="core rejected it"):
            await merge.__anext__()
        merge.close()
        assert aborted == ["b"]  # the open one is aborted
        c = RequestStream("c", aborted.append)
        merge = MergedStreams([c])
        merge.interrupt(RuntimeError("shutting down"))
        with pytest.raises(RuntimeError, match="shutting down"):
            await merge.__anext__()

    asyncio.run(main())
