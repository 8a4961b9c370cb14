"""What the front-end keeps for one request while it runs: one ``RequestState`` and, per sample
(core request), one ``SampleState``. Core outputs are deltas (the step's new token ids); each is
appended here once, and each output handed out is built from what was appended, as the
request's ``RequestOutputKind`` asks: the increments since the previous output (DELTA), the
whole output once at the end (FINAL_ONLY), or the whole output so far at every step, its lists
shared rather than copied (CUMULATIVE). Nothing already handed out is copied again."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from paged.core.frontend.detokenizer import IncrementalDetokenizer
from paged.core.frontend.outputs import (
    CompletionOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
    RequestOutputKind,
    pooled_output,
)

if TYPE_CHECKING:
    from paged.core.engine.outputs import EngineCoreOutput

_DELTA, _FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


class SampleState:
    """One sample of a request. ``token_ids`` and ``logprobs`` (None unless asked for) only grow;
    the text is the detokenizer's. ``new_*`` hold what was added since the last output handed
    out (``pending``: anything came): the core's own lists when one output came (no copy),
    joined when several did; not kept for FINAL_ONLY, whose one output is all new.
    ``live``: the core still runs it (false once the core finished it, or once a stop string
    ended it here and the caller was told to abort it)."""

    __slots__ = ("request", "request_id", "index", "detokenizer", "stop_token_ids", "token_ids", "logprobs",
                 "finish_reason", "stop_reason", "live", "last_token_time", "pending", "new_token_ids",
                 "new_logprobs", "new_text", "_last", "_finished_time", "pooled")

    def __init__(self, request: RequestState, request_id: str, index: int, detokenizer: IncrementalDetokenizer | None,
                 stop_token_ids: list[int], logprobs: bool) -> None:
        self.request = request
        self.request_id = request_id  # the core request's id
        self.index = index
        self.detokenizer = detokenizer
        self.stop_token_ids = stop_token_ids
        self.token_ids: list[int] = []
        self.logprobs: list[Any] | None = [] if logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.live = True
        self.last_token_time: float | None = None  # the asynchronous front-end's: its last token's arrival
        self.pending = False  # a core output came since the last output handed out
        self.new_token_ids: list[int] = []
        self.new_logprobs: list[Any] = []
        self.new_text = ""
        self._last: EngineCoreOutput | None = None  # the latest core output: the request's timestamps
        self._finished_time: float | None = None
        self.pooled: bytes | None = None  # a pooling request's vector (no detokenizer then)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, core_out: EngineCoreOutput) -> bool:
        """Add one core output of this (unfinished) sample. True when a stop string ended it
        here while the core still runs it (the caller aborts it in the core)."""
        if self.detokenizer is None:  # a pooling request: one output, its vector (or why it ended)
            self.pooled = core_out.pooled
            self.finish_reason = core_out.finish_reason or "stop"
            self.stop_reason = core_out.error or core_out.reject_reason
            self._last = core_out
            self.pending, self.live = True, False
            self._finished_time = core_out.finished_time if core_out.finished_time is not None else time.monotonic()
            return False
        new_ids, new_logprobs = core_out.new_token_ids, core_out.logprobs
        if core_out.prompt_logprobs is not None:  # the first prompt token has none
            self.request.prompt_logprobs = [None, *core_out.prompt_logprobs]
        detokenizer = self.detokenizer
        if len(new_ids) > 1 and detokenizer.has_stop_strings:
            # several tokens at once (speculative decoding): a stop string ends the output at the
            # token that completes it, as it would one token a step
            delta = ""
            for j, token in enumerate(new_ids):
                delta += detokenizer.update([token])
                if detokenizer.stopped:
                    new_ids, new_logprobs = new_ids[:j + 1], new_logprobs[:j + 1]
                    break
        else:
            delta = detokenizer.update(new_ids)
        self.token_ids.extend(new_ids)
        steps = self.request.output_kind is not _FINAL_ONLY  # (final: the increments are everything)
        if steps:  # increments last one step (each step's output is handed out), so they stay small
            self.new_token_ids = new_ids if not self.new_token_ids else self.new_token_ids + new_ids
        if self.logprobs is not None:
            self.logprobs.extend(new_logprobs)
            if steps:
                self.new_logprobs = new_logprobs if not self.new_logprobs else self.new_logprobs + new_logprobs
        stopped_here = False
        if detokenizer.stopped:
            stopped_here = core_out.finish_reason is None
            self.finish_reason = "stop"
            self.stop_reason = detokenizer.stop_reason
        elif core_out.finish_reason is not None:
            delta += detokenizer.finalize()
            self.finish_reason = core_out.finish_reason
            self.stop_reason = core_out.stop_token_id if core_out.stop_token_id in self.stop_token_ids else None
            if core_out.finish_reason == "rejected":  # turned away by the policy: why, for the client
                self.stop_reason = core_out.reject_reason
            elif core_out.finish_reason == "error":  # a plugin failed on it: who, and how
                self.stop_reason = core_out.error
        if delta and steps:
            self.new_text = delta if not self.new_text else self.new_text + delta
        self._last = core_out
        self.pending = True
        if self.finish_reason is not None:
            self.live = False
            # a stop string ends it here, before the core says so: now is its finish time
            self._finished_time = core_out.finished_time if core_out.finished_time is not None else time.monotonic()
        return stopped_here

    def metrics(self) -> RequestMetrics | None:
        last = self._last
        if last is None:
            return None
        return RequestMetrics(last.arrival_time, last.first_scheduled_time, last.first_token_time, self._finished_time,
                              last.num_cached_tokens, last.num_preemptions)

    def _hand_out(self, text: str, token_ids: list[int], logprobs: list[Any] | None) -> CompletionOutput:
        out = CompletionOutput(self.index, text, token_ids, self.finish_reason, self.stop_reason, logprobs,
                               self.new_text, self.new_token_ids, self.metrics())
        self.new_token_ids, self.new_logprobs, self.new_text, self.pending = [], [], "", False
        return out

    def delta(self) -> CompletionOutput:
        """What was added since the last output (DELTA)."""
        return self._hand_out(self.new_text, self.new_token_ids,
                              self.new_logprobs if self.logprobs is not None else None)

    def cumulative(self) -> CompletionOutput:
        """All so far, with this sample's own (growing) lists (CUMULATIVE)."""
        return self._hand_out(self.detokenizer.text, self.token_ids, self.logprobs)

    def final(self) -> CompletionOutput:
        """All of it, to a consumer that saw nothing before (FINAL_ONLY): everything is new."""
        self.new_text, self.new_token_ids = self.detokenizer.text, self.token_ids
        return self._hand_out(self.new_text, self.token_ids, self.logprobs)


class RequestState:
    """One request: its prompt, its ``samples`` (n), how its outputs are handed out
    (``output_kind``) and, in the asynchronous front-end, the ``stream`` they go to (None
    in-process: ``OutputProcessor.process`` returns them). Kept from ``InputProcessor.process``
    until its last output is handed out or it is aborted (``OutputProcessor.remove``)."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "output_kind", "samples", "num_unfinished", "stream",
                 "changed", "prompt_logprobs", "pooling")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.output_kind = output_kind
        self.samples: list[SampleState] = []
        self.num_unfinished = 0
        self.stream: Any = None  # paged.core.frontend.stream.RequestStream (AsyncLLM's)
        self.changed = False  # a sample changed in the step being processed
        self.prompt_logprobs: list[Any] | None = None  # when asked for: [None, entry per later prompt token]
        self.pooling: tuple[Any, dict] | None = None  # a pooling request: (PoolingParams, ModelInfo.pooling)

    def add_sample(self, request_id: str, detokenizer: IncrementalDetokenizer, stop_token_ids: list[int],
                   logprobs: bool) -> SampleState:
        sample = SampleState(self, request_id, len(self.samples), detokenizer, stop_token_ids, logprobs)
        self.samples.append(sample)
        self.num_unfinished += 1
        return sample

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    @property
    def sample_ids(self) -> list[str]:
        return [s.request_id for s in self.samples]

    def output(self) -> RequestOutput | None:
        """The output to hand out after a step that changed a sample (None: nothing for this
        consumer now, i.e. FINAL_ONLY before the end)."""
        if self.pooling is not None:
            return None if self.num_unfinished else self.final_output()
        kind = self.output_kind
        if kind is _DELTA:
            completions = [s.delta() for s in self.samples if s.pending]
        elif kind is _FINAL_ONLY:
            if self.num_unfinished:
                return None
            completions = [s.final() for s in self.samples]
        else:
            completions = [s.cumulative() for s in self.samples]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions,
                             finished=not self.num_unfinished, metrics=completions[0].metrics if completions else None,
                             prompt_logprobs=self.prompt_logprobs)

    def final_output(self) -> RequestOutput | PoolingRequestOutput:
        """The whole output of a finished request, whatever its kind (built once, e.g. for a
        trace recorder)."""
        if self.pooling is not None:
            sample = self.samples[0]
            params, info = self.pooling
            vector = None
            if sample.pooled is not None:
                vector = pooled_output(sample.pooled, params.normalize, params.dimensions, info)
            return PoolingRequestOutput(self.request_id, self.prompt, self.prompt_token_ids, vector, True,
                                        sample.finish_reason, sample.stop_reason, sample.metrics())
        completions = [s.final() for s in self.samples]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions, finished=True,
                             metrics=completions[0].metrics, prompt_logprobs=self.prompt_logprobs)
