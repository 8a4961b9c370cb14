"""Front-end cost per output token, against the length already generated (no model).

A fake engine core feeds the front-end one ``EngineCoreOutput`` per request per step (one new
token each, the last one finishing with "length"), as a decoding batch does. Two paths are timed:

* ``offline``: ``OutputProcessor.process`` (what ``LLMEngine.step`` / ``LLM.generate`` run after
  each core step), the outputs taken as they come;
* ``async``: ``AsyncLLM``'s output handler taking one core message per step from a fake socket
  (decode, observer, output processor, request state, delivery) plus a consumer task per
  request iterating its stream (what a server response does); no process behind it.

Each row is one output length; the cost is the CPU time of this thread spent in the front-end
(``time.thread_time``: what other processes take on a shared machine does not count) divided by
the tokens produced (requests x length), the best of ``--repeats`` rounds (each round measures
every cell once). A front-end that copies what it has
already sent at every step costs more per token as the length grows; one that hands out deltas
(or the final output once) stays flat. The detokenizer runs for real, on the default model's
tokenizer (the text is ordinary English, so the cost per token is that of real text).

    python benchmarks/frontend_output.py [--batch 8] [--lengths 128,512,2048,8192] [--repeats 3]
        [--logprobs]   # ask for logprobs (each token carries a TokenLogprobs)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' model helpers

from paged.core.engine.model_info import ModelInfo
from paged.core.engine.outputs import EngineCoreOutput
from paged.core.engine.sampler import TokenLogprobs
from paged.core.frontend.processor import InputProcessor, OutputProcessor
from paged.core.ipc.messages import Outputs, make_encoder, message_decoder
from paged.core.sampling_params import SamplingParams

try:  # the output kinds (absent from a front-end that predates them)
    from paged.core.frontend.outputs import RequestOutputKind
except ImportError:
    RequestOutputKind = None

TEXT = (
    "The history of the city begins with a small settlement on the river, where traders stopped to "
    "exchange grain, salt and cloth. Over the centuries it grew into a market town, then a port, and "
    "finally the capital of a province whose roads and bridges are still in use today. "
)


def load_tokenizer():
    from helpers.default_model import default_gguf
    from paged.core.loading.gguf import converted_model_dir
    from paged.core.loading.loader import load_tokenizer

    return load_tokenizer(str(converted_model_dir(default_gguf())))


def token_stream(tokenizer, length: int) -> list[int]:
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    return [ids[k % len(ids)] for k in range(length)]


def model_info(length: int) -> ModelInfo:
    return ModelInfo("/fake", max_model_len=length + 64, vocab_size=49152, eos_token_ids=[2],
                     num_blocks=1 << 20, block_size=16)


def core_steps(request_ids: list[str], tokens: list[int], logprobs: bool):
    """Each step's core outputs, built fresh as the core builds them (not timed: not the front-end's work)."""
    last = len(tokens) - 1
    for k, token in enumerate(tokens):
        finish = "length" if k == last else None
        yield [EngineCoreOutput(rid, [token], finish, None, [TokenLogprobs(token, -0.5, 1, [(token, -0.5)])] if logprobs
                                else [], 0.0, 0.0, 0.0, 1.0 if finish else None) for rid in request_ids]


def kinds() -> list:
    if RequestOutputKind is None:
        return [None]
    return [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE]


def kind_args(kind) -> dict:
    return {} if kind is None else {"output_kind": kind}


def params(length: int, logprobs: bool) -> SamplingParams:
    return SamplingParams(max_tokens=length, ignore_eos=True, logprobs=0 if logprobs else None)


def run_offline(tokenizer, batch: int, length: int, logprobs: bool, kind) -> float:
    """Seconds for the output processor to take ``batch`` requests through ``length`` steps."""
    inputs = InputProcessor(tokenizer, model_info(length))
    outputs = OutputProcessor()
    prompt = [1, 2, 3, 4]
    ids = [f"r{i}" for i in range(batch)]
    for rid in ids:
        parent, _ = inputs.process(rid, prompt, params(length, logprobs), **kind_args(kind))
        outputs.add(parent)
    finished = 0
    elapsed = 0.0
    clock = time.thread_time
    for step in core_steps(ids, token_stream(tokenizer, length), logprobs):
        start = clock()
        result = outputs.process(step)
        outs = result[0] if isinstance(result, tuple) else result.outputs  # (a front-end before ProcessedOutputs)
        elapsed += clock() - start
        finished += sum(o.finished for o in outs)
    assert finished == batch, finished
    return elapsed


class FakePull:
    """The output socket: the encoded core messages the benchmark feeds it."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()

    async def poll(self, timeout_ms: int) -> bool:
        if self.queue.empty():
            await asyncio.sleep(0)
        return not self.queue.empty()

    async def recv(self) -> bytes:
        return await self.queue.get()


class FakeClient:
    """What AsyncLLM uses of its EngineCoreClient, with no core behind it."""

    def __init__(self, info: ModelInfo) -> None:
        self.num_cores = 1
        self.model_info, self.model_infos = info, [info]
        self.pid, self.pids = 1, [1]
        self.pull, self.decoder = FakePull(), message_decoder()
        self.alive, self.closed, self._closed = True, False, False  # (_closed: a front-end before `closed`)
        self.multi_node, self.keep_serving, self.lost, self.hosts = False, False, {}, [""]

    def live_ranks(self) -> list[int]:
        return [0]

    def core_down(self, rank: int) -> str | None:
        return None

    async def send(self, msg, core: int = 0) -> None:
        pass

    def send_nowait(self, msg, core: int = 0) -> None:
        pass

    def death_message(self) -> str:
        return "no core"

    def close(self) -> None:
        pass


def run_async(tokenizer, batch: int, length: int, logprobs: bool, kind) -> float:
    """Seconds for AsyncLLM to take ``batch`` requests through ``length`` core messages (decoded
    by its output handler from a fake socket), each request's consumer iterating its stream as
    the outputs come."""
    from paged.core.config import load_config
    from paged.core.frontend.async_llm import AsyncLLM

    async def main() -> float:
        client = FakeClient(model_info(length))
        llm = AsyncLLM(load_config(None, {}), client, tokenizer)
        ids = [f"r{i}" for i in range(batch)]
        streams = [await llm.add_request(rid, [1, 2, 3, 4], params(length, logprobs), **kind_args(kind)) for rid in ids]
        received = [0] * batch

        async def consume(i: int, stream) -> None:
            async for out in stream:
                received[i] += len(out.outputs[0].new_token_ids)

        consumers = [asyncio.ensure_future(consume(i, s)) for i, s in enumerate(streams)]
        encoder = make_encoder()
        messages = [encoder.encode(Outputs(step, float(k)))
                    for k, step in enumerate(core_steps(ids, token_stream(tokenizer, length), logprobs))]
        await asyncio.sleep(0)
        start = time.thread_time()
        for payload in messages:  # one core message per step, the consumers running in between
            client.pull.queue.put_nowait(payload)
            await asyncio.sleep(0)
        await asyncio.gather(*consumers)
        elapsed = time.thread_time() - start
        llm.shutdown()
        if kind is None or kind != RequestOutputKind.FINAL_ONLY:
            assert received == [length] * batch, received
        return elapsed

    return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="requests decoding together")
    parser.add_argument("--lengths", default="128,512,2048,8192")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--logprobs", action="store_true")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    tokenizer = load_tokenizer()
    print(f"front-end cost per output token (us), batch {args.batch}, best of {args.repeats}"
          f"{', with logprobs' if args.logprobs else ''}")
    columns = [(path, kind) for path in ("offline", "async") for kind in kinds()]
    names = [f"{path} {kind.name.lower() if kind is not None else 'as is'}" for path, kind in columns]
    print(f"{'tokens':>7} " + " ".join(f"{n:>18}" for n in names))
    best = {}
    for _ in range(args.repeats):  # every cell once per round: a busy machine slows all lengths alike
        for length in lengths:
            for path, kind in columns:
                run = run_offline if path == "offline" else run_async
                seconds = run(tokenizer, args.batch, length, args.logprobs, kind)
                key = (length, path, kind)
                best[key] = min(best.get(key, seconds), seconds)
    for length in lengths:
        row = [best[(length, path, kind)] / (args.batch * length) * 1e6 for path, kind in columns]
        print(f"{length:>7} " + " ".join(f"{us:>18.2f}" for us in row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
