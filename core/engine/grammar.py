"""Structured outputs in the engine core: constraints compiled off the step, matchers per request.

``StructuredOutputManager.submit(params)`` returns a future of a fresh ``GrammarMatcher`` for a
request's constraint (its ``StructuredOutputParams``), built in a small thread pool: the backend
itself (tokenizer tables, ~1 s) on the first constrained request, then the compiled constraint
(cached by ``params.cache_key()``, LRU), then a fresh matcher. The engine core holds the request
outside the scheduler until the future is done, so the batch never waits for a compilation.
Nothing here runs per token: the matchers' ``fill_bitmask`` is called by the sampler and
``accept_token`` by the scheduler's ``update_from_output``.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from paged.core.structured_output import GrammarMatcher, StructuredOutputBackend, StructuredOutputParams

logger = logging.getLogger("paged")


class StructuredOutputManager:
    def __init__(
        self,
        spec,  # StructuredOutputBackendSpec
        options,
        tokenizer_dir: str,
        vocab_size: int,
        eos_token_ids: list[int],
        max_workers: int = 2,
        cache_size: int = 256,
    ) -> None:
        self.spec = spec
        self.options = options
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self._pool: ThreadPoolExecutor | None = None  # started on the first constrained request
        self._max_workers = max_workers
        self._lock = threading.Lock()
        self._backend: StructuredOutputBackend | None = None
        self._compiled: OrderedDict[str, Future] = OrderedDict()
        self.code = None  # the backend's PluginCode (set by the engine core), to name it in failures

    def submit(self, params: StructuredOutputParams) -> Future:
        """A future of a fresh ``GrammarMatcher`` for ``params`` (its exception: the compile error)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix="paged-grammar")
        return self._pool.submit(self._build, params)

    def _get_backend(self) -> StructuredOutputBackend:
        with self._lock:
            if self._backend is None:
                from paged.core.loading.tokenizer import load_tokenizer

                tokenizer = load_tokenizer(self.tokenizer_dir)
                self._backend = self.spec.factory(tokenizer, self.vocab_size, self.eos_token_ids, self.options)
            return self._backend

    def compiled(self, params: StructuredOutputParams) -> Any:
        """The compiled constraint; one compilation per cache key even when requests race (the
        first thread compiles, the others wait for its future, which is running, not queued)."""
        backend = self._get_backend()
        key = params.cache_key()
        with self._lock:
            future = self._compiled.get(key)
            mine = future is None
            if mine:
                future = Future()
                self._compiled[key] = future
                while len(self._compiled) > self.cache_size:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(key)
        if mine:
            try:
                future.set_result(backend.compile(params))
            except BaseException as e:
                with self._lock:
                    self._compiled.pop(key, None)  # an error is not cached: the next try says it again
                future.set_exception(e)
        return future.result()

    def _build(self, params: StructuredOutputParams) -> GrammarMatcher:
        return self._get_backend().matcher(self.compiled(params))

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
