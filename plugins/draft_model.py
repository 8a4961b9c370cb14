"""The ``draft_model`` proposer: a smaller model that shares the target's vocabulary guesses the
next tokens, greedily, with its own paged KV cache.

It is paged's own machinery run a second time inside the engine core: a ``ModelRunner`` for the
draft model (its weights, its attention backend, its KV cache of ``kv_cache_memory_gib``) and a
``KVCacheManager`` over that cache (no prefix caching), driven by this proposer instead of a
scheduler. Per request it keeps a ``Request`` of the draft side whose tokens are the target's
tokens plus its own last drafts, and how many of them its cache holds. Each call:

1. **Sync**: the target's tokens since the last call are compared with the drafts proposed
   then. The draft request keeps the longest common prefix, and its computed count is rolled back
   to it (the cache slots of rejected drafts are overwritten later, as the engine's are); then the
   tokens the target accepted or sampled are appended.
2. **Catch up**: one runner step computes every request's uncomputed tokens (usually the bonus
   token, or the prompt when a request is new) and samples the first draft at the last position.
3. **Draft**: ``num_tokens - 1`` more one-token steps for all requests at once, greedy.

The same model as its own draft therefore proposes exactly the target's greedy tokens (every
draft is accepted when the target decodes greedily: ``tests/core/engine/test_spec_decode.py``).
Drafts are point masses (greedy), which is what the engine's exact verification takes (see
``paged.core.speculative``). A request that does not fit the draft's cache or its
``max_model_len`` gets no drafts (it decodes as without speculation); the proposer needs
tensor parallelism off (the draft model would join the target's collectives).
"""

from __future__ import annotations

import logging
from typing import Iterable, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field

from paged.core.speculative import DraftRequest, ProposerContext

logger = logging.getLogger("paged")


class DraftModelOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(..., description="the draft model: a model directory, .gguf file or hub id whose vocabulary "
                       "is the target's (e.g. a smaller model of the same family)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="the draft model's dtype")
    quantization: str = Field("auto", description="the draft model's weight quantization (as model.quantization)")
    kv_cache_memory_gib: float = Field(0.25, gt=0, description="the draft model's own KV cache, GiB")
    block_size: int = Field(16, ge=1, le=256, description="tokens per block of the draft's KV cache")


class DraftModelProposer:
    def __init__(self, options: DraftModelOptions, context: ProposerContext) -> None:
        import torch

        from paged.core.config import load_config, resolve_plugins
        from paged.core.engine.kv_cache_manager import KVCacheManager
        from paged.core.engine.model_runner import ModelRunner
        from paged.core.errors import ConfigError
        from paged.core.loading.model_config import resolve_model
        from paged.core.registry import get_registry
        from paged.core.sampling_params import SamplingParams

        if context.tensor_parallel_size > 1:
            raise ConfigError("speculative.method: 'draft_model' runs with tensor_parallel_size 1 only (the draft "
                              f"model would join the target's collectives); got {context.tensor_parallel_size}")
        config = load_config(None, {
            "device": context.device,
            "model": {"model": options.model, "dtype": options.dtype, "quantization": options.quantization},
            "cache": {"kv_cache_memory_gib": options.kv_cache_memory_gib, "block_size": options.block_size,
                      "enable_prefix_caching": False},
            "scheduler": {"max_num_seqs": 4096, "max_num_batched_tokens": 1 << 20},
        })
        registry = get_registry()
        device = torch.device(context.device)
        model = resolve_model(config, registry, device)
        if model.vocab_size != context.vocab_size:
            raise ConfigError(f"speculative.options.model: the draft model {options.model!r} has a vocabulary of "
                              f"{model.vocab_size} tokens, the target {context.vocab_size}: a draft model must share "
                              "the target's tokenizer")
        self.runner = ModelRunner(config, resolve_plugins(config, registry, device.type), model, device, registry)
        self.kv = KVCacheManager(self.runner.num_blocks, options.block_size, enable_caching=False)
        self.max_model_len = model.max_model_len
        self.params = SamplingParams(temperature=0, max_tokens=1 << 30)
        self.requests: dict = {}  # request id -> the draft side's Request
        self.synced: dict[str, int] = {}  # request id -> the target's length at the last call
        self._finished: list[str] = []  # forgotten since the last step: the runner drops them then
        logger.info("draft model %s (%s) for speculative decoding: %d KV blocks of %d tokens", options.model,
                    str(model.dtype).removeprefix("torch."), self.runner.num_blocks, options.block_size)

    # --- the contract -----------------------------------------------------------------------
    def propose(self, requests: Sequence[DraftRequest], num_tokens: int) -> list[list[int]]:
        mine = [self._sync(view, num_tokens) for view in requests]
        active = [r for r in mine if r is not None]
        drafts: dict[str, list[int]] = {r.request_id: [] for r in active}
        for _ in range(num_tokens):
            if not active:
                break
            active = self._step(active, drafts)
        return [drafts.get(view.request_id, []) for view in requests]

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            self.synced.pop(request_id, None)
            if request is not None:
                self.kv.free(request)
                self._finished.append(request_id)

    # --- the draft side ------------------------------------------------------------------------
    def _sync(self, view: DraftRequest, num_tokens: int):
        """The draft request of ``view``, its tokens made the target's (drafts the target did not
        accept are dropped, its computed count rolled back to what still holds); None when it
        cannot draft (too long for the draft model)."""
        from paged.core.engine.request import Request, RequestStatus

        tokens = view.token_ids
        rid = view.request_id
        if len(tokens) + num_tokens > self.max_model_len:
            self.forget([rid])
            return None
        request = self.requests.get(rid)
        if request is None:
            request = Request(rid, list(tokens), self.params)
            request.status = RequestStatus.RUNNING
            self.requests[rid] = request
        else:
            start = self.synced[rid]  # the target had this many tokens last time; ours after it were drafts
            ours = request.all_token_ids
            same = start
            end = min(len(ours), len(tokens))
            while same < end and ours[same] == tokens[same]:
                same += 1
            del ours[same:]
            ours.extend(tokens[same:])
            request.num_computed_tokens = min(request.num_computed_tokens, same)
        self.synced[rid] = len(tokens)
        return request

    def _step(self, active: list, drafts: dict[str, list[int]]) -> list:
        """One runner step: every active request's uncomputed tokens, a greedy token sampled at
        the last; returns the requests that took part (those the cache could not fit drop out)."""
        from paged.core.engine.scheduler import ScheduledRequest, SchedulerOutput

        held = self.runner.input_batch
        scheduled = []
        for request in active:
            num_new = request.num_tokens - request.num_computed_tokens
            new_blocks = self.kv.allocate_slots(request, num_new)
            if new_blocks is None:  # the draft's cache is full: no drafts for this one
                self.forget([request.request_id])
                continue
            block_ids = ([b.block_id for b in new_blocks] if request.request_id in held
                         else self.kv.get_block_ids(request.request_id))
            scheduled.append(ScheduledRequest(request, request.num_computed_tokens, num_new, block_ids))
            request.num_computed_tokens += num_new
        finished, self._finished = self._finished, []
        result = self.runner.execute(SchedulerOutput(scheduled, finished_request_ids=finished))
        out = []
        for s in scheduled:
            request = s.request
            token = result.sampled_token_ids.get(request.request_id)
            if token is None:
                continue
            request.all_token_ids.append(token)  # a draft: the next call keeps it only if the target does
            drafts[request.request_id].append(token)
            out.append(request)
        return out
