"""The in-process engine: add_request / step / abort_request.

One ``step()``: the scheduler picks the batch, the model runner computes it and samples, the
scheduler appends tokens and frees finished requests, the detokenizer turns new tokens into text
and applies stop strings. A request with ``n > 1`` runs as n child requests that share the
prompt's KV blocks through the prefix cache (the first child's prompt blocks are cached when
allocated, and its siblings, admitted in the same step, hit them).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

from paged.core.config import EngineConfig, resolve_plugins
from paged.core.detokenizer import IncrementalDetokenizer
from paged.core.errors import InvalidRequestError
from paged.core.kv_cache_manager import KVCacheManager
from paged.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from paged.core.request import Request, RequestStatus
from paged.core.sampling_params import SamplingParams
from paged.core.scheduler import Scheduler

logger = logging.getLogger("paged")


@dataclass
class EngineStats:
    """Counters since start; the CLI summary and /metrics read these."""

    num_requests: int = 0
    num_finished: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    peak_kv_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


@dataclass
class _Child:
    request: Request
    detokenizer: IncrementalDetokenizer
    output: CompletionOutput


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Child] = field(default_factory=list)
    arrival_time: float = 0.0

    @property
    def finished(self) -> bool:
        return all(c.output.finished for c in self.children)


class LLMEngine:
    def __init__(self, config: EngineConfig, registry=None) -> None:
        from paged.core.model_runner import ModelRunner, resolve_device
        from paged.core.plugins import get_registry
        from paged.models.loader import load_tokenizer

        self.config = config
        self.registry = registry or get_registry()
        self.device = resolve_device(config.device)
        self.plugins = resolve_plugins(config, self.registry, self.device.type)
        logger.info(
            "device %s, attention backend %r, policy %r", self.device, self.plugins.attention.name, self.plugins.policy.name
        )
        self.runner = ModelRunner(config, self.plugins, self.registry, self.device)
        self.tokenizer = load_tokenizer(config.model.tokenizer or self.runner.model_dir)
        self.max_model_len = self.runner.max_model_len
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        policy = self.plugins.policy.factory(self.plugins.policy_options)
        self.scheduler = Scheduler(
            policy,
            self.kv_cache_manager,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            long_prefill_token_threshold=config.scheduler.long_prefill_token_threshold,
            enable_chunked_prefill=config.scheduler.enable_chunked_prefill,
        )
        self.eos_token_ids = _eos_token_ids(self.runner.model_dir, self.tokenizer)
        self.vocab_size = self.runner.vocab_size
        self.stats = EngineStats()
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, _Parent] = {}
        self._ids = itertools.count()

    # --- requests --------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def apply_chat_template(self, messages: list[dict]) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("messages: this model's tokenizer has no chat template")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def add_request(
        self,
        request_id: str | None,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        add_special_tokens: bool = True,
    ) -> str:
        """Validate and queue a request; raises InvalidRequestError (nothing is queued then)."""
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._parents:
            raise InvalidRequestError(f"request_id: {request_id!r} is already in use")
        if isinstance(prompt, str):
            text = prompt
            token_ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        else:
            text = None
            token_ids = [int(t) for t in prompt]
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"prompt_token_ids: {bad[:5]} out of range; token ids must be in [0, {self.vocab_size})"
                )
        if not isinstance(priority, int):
            raise InvalidRequestError(f"priority: invalid value {priority!r}; must be an integer")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max(self.max_model_len - len(token_ids), 1)
        self.scheduler.check_request(len(token_ids), max_tokens)

        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        parent = _Parent(request_id, text, token_ids, arrival_time=arrival_time)
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        extra_stop_ids = [] if params.ignore_eos else [t for t in self.eos_token_ids[1:] if t not in params.stop_token_ids]
        for index in range(params.n):
            child_params = params
            if params.n > 1 or extra_stop_ids:
                seed = None if params.seed is None else params.seed + index
                child_params = params.copy(n=1, seed=seed, stop_token_ids=params.stop_token_ids + extra_stop_ids)
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            request = Request(
                child_id,
                token_ids,
                child_params,
                arrival_time=arrival_time,
                priority=priority,
                cache_salt=cache_salt,
                eos_token_id=eos,
                max_tokens=max_tokens,
            )
            self.scheduler.add_request(request)
            child = _Child(
                request,
                IncrementalDetokenizer(self.tokenizer, token_ids, child_params),
                CompletionOutput(index, logprobs=[] if params.logprobs is not None else None),
            )
            parent.children.append(child)
            self._child_to_parent[child_id] = parent
        self._parents[request_id] = parent
        self.stats.num_requests += 1
        self.stats.prompt_tokens += len(token_ids) * params.n
        return request_id

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """End requests now and free their blocks; unknown or finished ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            parent = self._parents.pop(request_id, None)
            if parent is None:
                continue
            ids = [c.request.request_id for c in parent.children]
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            for child_id in ids:
                self._child_to_parent.pop(child_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._parents)

    # --- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return an output for every request that produced something."""
        scheduler_output = self.scheduler.schedule()
        result = self.runner.execute(scheduler_output)
        updated = self.scheduler.update_from_output(scheduler_output, result.sampled_token_ids)
        self.stats.num_steps += 1
        self.stats.num_preemptions += len(scheduler_output.preempted_request_ids)
        self.stats.peak_kv_usage = max(self.stats.peak_kv_usage, self.kv_cache_manager.usage)

        touched: dict[str, _Parent] = {}
        stopped_by_string: list[str] = []
        for request in updated:
            parent = self._child_to_parent.get(request.request_id)
            if parent is None:
                continue
            child = parent.children[0] if len(parent.children) == 1 else next(
                c for c in parent.children if c.request is request
            )
            token = request.output_token_ids[-1]
            out = child.output
            out.token_ids.append(token)
            out.new_token_ids.append(token)
            self.stats.generation_tokens += 1
            if out.logprobs is not None and request.request_id in result.logprobs:
                out.logprobs.append(result.logprobs[request.request_id])
            delta = child.detokenizer.update([token])
            if child.detokenizer.stopped:
                if not request.is_finished:
                    stopped_by_string.append(request.request_id)
                out.finish_reason = "stop"
                out.stop_reason = child.detokenizer.stop_reason
            elif request.is_finished:
                delta += child.detokenizer.finalize()
                out.finish_reason = request.status.finish_reason
                if request.status == RequestStatus.FINISHED_STOPPED:
                    out.stop_reason = token if token in request.sampling_params.stop_token_ids else None
            out.new_text += delta
            out.text += delta
            touched[parent.request_id] = parent
        if stopped_by_string:
            self.scheduler.finish_requests(stopped_by_string, RequestStatus.FINISHED_STOPPED)

        outputs = [self._make_output(parent) for parent in touched.values()]
        for parent in touched.values():
            if parent.finished:
                self._finish(parent)
        return outputs

    def _make_output(self, parent: _Parent) -> RequestOutput:
        completions = []
        for child in parent.children:
            out = child.output
            out.metrics = _metrics(child.request)
            snapshot = CompletionOutput(
                index=out.index,
                text=out.text,
                token_ids=list(out.token_ids),
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
                logprobs=list(out.logprobs) if out.logprobs is not None else None,
                new_text=out.new_text,
                new_token_ids=out.new_token_ids,
                metrics=out.metrics,
            )
            out.new_text, out.new_token_ids = "", []
            completions.append(snapshot)
        return RequestOutput(
            parent.request_id,
            parent.prompt,
            parent.prompt_token_ids,
            completions,
            finished=parent.finished,
            metrics=completions[0].metrics,
        )

    def _finish(self, parent: _Parent) -> None:
        self._parents.pop(parent.request_id, None)
        self.stats.num_finished += 1
        for child in parent.children:
            self._child_to_parent.pop(child.request.request_id, None)
        stats = self.kv_cache_manager.prefix_cache_stats
        self.stats.prefix_cache_queries, self.stats.prefix_cache_hits = stats.queries, stats.hits


def _metrics(request: Request) -> RequestMetrics:
    return RequestMetrics(
        arrival_time=request.arrival_time,
        first_scheduled_time=request.first_scheduled_time,
        first_token_time=request.first_token_time,
        finished_time=request.finished_time,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        num_preemptions=request.num_preemptions,
    )


def _eos_token_ids(model_dir, tokenizer) -> list[int]:
    """EOS ids: generation_config.json first (it may list several), else the tokenizer's."""
    import json
    from pathlib import Path

    ids: list[int] = []
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        value = json.loads(path.read_text()).get("eos_token_id")
        if isinstance(value, int):
            ids = [value]
        elif isinstance(value, list):
            ids = [int(v) for v in value]
    if not ids and tokenizer.eos_token_id is not None:
        ids = [int(tokenizer.eos_token_id)]
    return ids
