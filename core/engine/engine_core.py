"""The engine core: scheduler + model runner, working in token ids only.

``step()`` = schedule, execute, append sampled tokens / free finished requests, and report one
``EngineCoreOutput`` per request that got a token (or finished). Tokenization, detokenization,
stop strings and n > 1 fan-out belong to the front-end (paged.core.frontend.processor), so the same core
runs in-process (``LLMEngine``) or in its own process behind ZeroMQ.

Plugin failures are contained here (``paged.core.engine.plugin_faults`` says which are per
request and which stop the engine): a request a plugin failed on ends with finish reason
"error" and the message; a fatal failure raises ``EngineError`` from ``step`` and every later
call raises it again (the engine has stopped).
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Callable, Iterable

from paged.core.config import EngineConfig, check_quantization, resolve_plugins, resolve_structured_output
from paged.core.engine.grammar import StructuredOutputManager
from paged.core.engine.kv_cache_manager import KVCacheManager
from paged.core.engine.model_info import ModelInfo
from paged.core.engine.pooling import resolve_pooling
from paged.core.engine.outputs import EngineCoreOutput, EngineCoreRequest
from paged.core.engine.request import Request, RequestStatus
from paged.core.engine.scheduler import Scheduler, SchedulerOutput
from paged.core.engine.plugin_faults import PluginCode, describe, log_fault, plugin_code
from paged.core.errors import ConfigError, EngineError, InvalidRequestError, RequestRejectedError
from paged.core.loading.model_config import resolve_model
from paged.core.lora import LoRARequest
from paged.core.pooling_params import NOT_A_GENERATING_ENGINE, NOT_A_POOLING_ENGINE

logger = logging.getLogger("paged")

LORA_DISABLED = "lora_request: LoRA adapters are not enabled in this engine; start it with --enable-lora (lora.enable_lora)"


@dataclass
class CoreStats:
    num_steps: int = 0
    num_preemptions: int = 0
    peak_kv_usage: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # speculative decoding (paged.core.engine.spec_decode.SpecDecodeStats)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0


class EngineCore:
    def __init__(self, config: EngineConfig, registry=None) -> None:
        from paged.core.engine.tp_ranks import TensorParallelRanks, configure_cpu_process
        from paged.core.engine.model_runner import ModelRunner, resolve_device
        from paged.core.registry import get_registry

        self.config = config
        registry = registry or get_registry()
        self.device = resolve_device(config.device)
        self.plugins = resolve_plugins(config, registry, self.device.type)
        # Every plugin's options are checked before any weight loads.
        check_quantization(config, registry)
        structured_output = resolve_structured_output(config, registry)
        speculative = self._resolve_proposer(config, registry)
        # The model's settings are settled (and checked) before any rank starts or loads weights.
        self.model_config = resolve_model(config, registry, self.device)
        pooling = resolve_pooling(config, registry, str(self.model_config.model_dir), self.model_config.hf_config,
                                  self.model_config.classification_head)
        configure_cpu_process(config, self.device)
        # Tensor parallelism: this process becomes rank 0 (the other ranks start or join here).
        self.tp_ranks = TensorParallelRanks.start(config, self.device)
        if self.tp_ranks is not None:
            self.device = self.tp_ranks.device
        logger.info(
            "device %s, attention backend %r, policy %r", self.device, self.plugins.attention.name, self.plugins.policy.name
        )
        try:
            self.runner = ModelRunner(config, self.plugins, self.model_config, self.device, registry)
        except BaseException:
            if self.tp_ranks is not None:
                self.tp_ranks.abort()  # the other ranks may be inside a collective: no stop broadcast
            raise
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
            sliding_window=getattr(self.runner, "kv_sliding_window", None),
        )
        self.scheduler = Scheduler(
            self.plugins.policy.factory(self.plugins.policy_options),
            self.kv_cache_manager,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_model_len=self.model_config.max_model_len,
            long_prefill_token_threshold=config.scheduler.long_prefill_token_threshold,
            enable_chunked_prefill=config.scheduler.enable_chunked_prefill,
        )
        self.model_info = ModelInfo(
            model_dir=str(self.model_config.model_dir),
            max_model_len=self.model_config.max_model_len,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=self.model_config.eos_token_ids,
            num_blocks=self.runner.num_blocks,
            block_size=config.cache.block_size,
            tokenizer_dir=str(self.model_config.tokenizer_dir),
            runner=config.model.runner,
            sliding_window=self.kv_cache_manager.sliding_window,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        )
        self.pooling = pooling
        if pooling is not None:
            pooling.build(self.model_config, self.device)
            self.runner.pooling = pooling
            self.model_info.pooling = pooling.info()
            logger.info("pooling runner: %s%s", pooling.name, f" ({pooling.activation} over {pooling.labels})"
                        if pooling.labels else f", normalize {str(pooling.normalize).lower()}")
        spec, options = structured_output
        self.structured_output = StructuredOutputManager(
            spec, options, self.model_info.tokenizer_dir or self.model_info.model_dir, self.model_config.vocab_size,
            self.model_info.eos_token_ids, max_workers=config.structured_output.compile_workers,
        )
        self.plugin_code = self._plugin_code(registry)
        self.scheduler.policy_code = self.plugin_code[0]
        self.scheduler.grammar_code = self.structured_output.code = self.plugin_code[-1]
        if self.runner.sampler is not None:
            self.runner.sampler.grammar_code = self.plugin_code[-1]
        self.speculator = self._speculator(config, registry, *speculative) if speculative else None
        self.scheduler.speculator = self.speculator
        if self.speculator is not None:
            self.speculator.grammar_code = self.plugin_code[-1]
        self.lora = self.runner.lora  # the LoRA adapters (paged.core.engine.lora_manager), or None
        if self.lora is not None:
            self.scheduler.max_loras = config.lora.max_loras
            self.lora.in_use = self._loras_in_use
            self.model_info.max_loras = config.lora.max_loras
            self.model_info.max_lora_rank = config.lora.max_lora_rank
            for lora_request in config.lora.module_requests():  # --lora-modules: read and checked now
                self.lora.add(lora_request)
        elif config.lora.lora_modules:
            raise ConfigError("lora.lora_modules: adapters are given but LoRA is off; add --enable-lora")
        self.dead: str | None = None  # set when a fatal failure stopped the engine
        # Constrained requests whose matcher is being built: outside the scheduler until ready.
        self.compiling: dict[str, tuple[Request, Future]] = {}
        self.stats = CoreStats()
        # Called with each step's SchedulerOutput right after scheduling, before the model runs
        # (the policy lab records steps this way); empty in serving.
        self.schedule_observers: list[Callable[[SchedulerOutput], None]] = []

    @staticmethod
    def _resolve_proposer(config: EngineConfig, registry):
        """``speculative.method``'s spec and validated options (before any weight loads), or None."""
        from paged.core.config import validate_options

        if config.speculative.method is None:
            return None
        spec = registry.speculative_proposer(config.speculative.method)
        return spec, validate_options(spec, config.speculative.options, "speculative.options")

    def _speculator(self, config: EngineConfig, registry, spec, options):
        """The proposer built and wrapped (paged.core.engine.spec_decode.Speculator)."""
        from paged.core.engine.spec_decode import Speculator
        from paged.core.speculative import ProposerContext

        settings = config.speculative
        context = ProposerContext(self.model_config.vocab_size, settings.num_speculative_tokens,
                                  str(self.model_config.model_dir), str(self.device),
                                  config.parallel.tensor_parallel_size)
        proposer = spec.factory(options, context)
        code = plugin_code("speculative proposer", spec.name, registry.owner.get(("speculative_proposers", spec.name)),
                           spec.factory, proposer)
        logger.info("speculative decoding: %s, up to %d draft tokens a step%s", spec.name,
                    settings.num_speculative_tokens,
                    f", off above {settings.disable_by_batch_size} decoding requests"
                    if settings.disable_by_batch_size else "")
        return Speculator(proposer, code, spec.name, settings.num_speculative_tokens, self.model_config.vocab_size,
                          self.model_config.max_model_len, settings.disable_by_batch_size,
                          settings.min_acceptance_rate)

    def _plugin_code(self, registry) -> list[PluginCode]:
        """The selected plugins' code, to name them in failures: policy first, grammar last."""
        owner = registry.owner.get
        plugins, model = self.plugins, self.model_config
        found = [
            plugin_code("policy", plugins.policy.name, owner(("policies", plugins.policy.name)), self.scheduler.policy),
            plugin_code("attention backend", plugins.attention.name, owner(("attention_backends", plugins.attention.name)),
                        plugins.attention.factory, self.runner.backend),
            plugin_code("model", model.architecture, owner(("models", model.spec.architecture)), model.spec.factory,
                        self.runner.model),
        ]
        quantizer = getattr(self.runner, "quantizer", None)
        for name, (spec, _) in (quantizer.methods.items() if quantizer is not None else ()):
            found.append(plugin_code("quantization method", name, owner(("quantization_methods", name)), spec.quantize))
        pooling = getattr(self, "pooling", None)
        if pooling is not None and pooling.pooler is not None:
            found.append(plugin_code("pooler", pooling.name, owner(("poolers", pooling.name)), pooling.spec.factory,
                                     pooling.pooler))
        spec = self.structured_output.spec
        found.append(plugin_code("structured-output backend", spec.name, owner(("structured_output_backends", spec.name)),
                                 spec.factory, spec.validate))
        return found

    def _stop(self, error: Exception, during: str) -> EngineError:
        """A fatal failure: the engine stops; the error names who raised (logged once)."""
        if isinstance(error, EngineError):
            message = str(error)
        else:
            policy = self.plugin_code[0]
            message = describe(error, self.plugin_code, policy if during == "schedule" else None,
                               "scheduling (its sort_key values must compare with each other)")
            log_fault(message, error)
        self.dead = f"the engine stopped: {message}"
        return EngineError(self.dead)

    def add_request(self, request: EngineCoreRequest | Request) -> None:
        """Queue a request: a front-end's ``EngineCoreRequest`` (its ``Request`` is built here)
        or a ``Request`` built by an engine-level caller (tests, the lab). Raises
        InvalidRequestError if it could never run. A constrained one waits here, outside the
        scheduler, until its grammar is compiled."""
        if self.dead is not None:
            raise EngineError(self.dead)
        if isinstance(request, EngineCoreRequest):
            request = request.to_request()
        self._check_runner(request)
        self._check_lora(request)
        params = request.sampling_params.structured_output
        if params is None:
            self.scheduler.add_request(request)
            return
        if request.request_id in self.scheduler.requests or request.request_id in self.compiling:
            raise InvalidRequestError(f"request_id: {request.request_id!r} is already in use")
        self.scheduler.check_request(request.num_prompt_tokens, request.max_tokens)
        self.compiling[request.request_id] = (request, self.structured_output.submit(params))

    # --- LoRA adapters (paged.core.lora) ----------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter: read and check it now (InvalidRequestError naming the file and the
        field), so that no step reads a file. True once it is held."""
        if self.dead is not None:
            raise EngineError(self.dead)
        if self.lora is None:
            raise InvalidRequestError(LORA_DISABLED)
        self.lora.add(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter once no unfinished request uses it; False if it is not held."""
        return self.lora is not None and self.lora.remove(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.lora is None else self.lora.list()

    def _loras_in_use(self) -> set[int]:
        """The adapters of the unfinished requests (the manager never drops those)."""
        ids = {r.lora_int_id for r in self.scheduler.requests.values()}
        ids.update(r.lora_int_id for r, _ in self.compiling.values())
        ids.discard(0)
        return ids

    def _check_lora(self, request: Request) -> None:
        """A request's adapter is held (read again if it was dropped from memory)."""
        if request.lora_request is None:
            return
        if self.lora is None:
            raise InvalidRequestError(LORA_DISABLED)
        if request.pooling_params is not None:
            raise InvalidRequestError("lora_request: LoRA adapters apply to generation, not to the pooling runner")
        self.lora.add(request.lora_request)

    def _check_runner(self, request: Request) -> None:
        """The pooling runner takes pooling requests only, the generate runner generating ones."""
        if self.pooling is None:
            if request.pooling_params is not None:
                raise InvalidRequestError(NOT_A_POOLING_ENGINE)
            return
        if request.pooling_params is None:
            raise InvalidRequestError(NOT_A_GENERATING_ENGINE)
        request.pool_every_token = self.pooling.needs_all_tokens

    def abort_requests(self, request_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        request_ids = list(request_ids)
        for request_id in request_ids:
            entry = self.compiling.pop(request_id, None)
            if entry is not None:
                entry[1].cancel()
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.compiling)

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Move the requests whose matcher is ready into the scheduler; end those whose
        constraint failed to compile (finish_reason "error"; the front-end validated it, so this
        is a backend limit that only a full compile finds). Waits a little when nothing else can
        run, rather than spinning."""
        if not self.scheduler.has_unfinished_requests():
            wait([f for _, f in self.compiling.values()], timeout=0.05, return_when=FIRST_COMPLETED)
        failed = []
        for request_id, (request, future) in list(self.compiling.items()):
            if not future.done():
                continue
            del self.compiling[request_id]
            try:
                request.grammar = future.result()
            except Exception as e:
                request.error = describe(e, [self.structured_output.code], self.structured_output.code, "compile")
                log_fault(request.error, e, request_id=request_id)
                request.status = RequestStatus.FINISHED_ERROR
                failed.append(EngineCoreOutput.ended(request))
                continue
            try:
                self.scheduler.add_request(request)  # the policy's admission control decides now
            except RequestRejectedError as e:
                request.status = RequestStatus.FINISHED_REJECTED
                request.reject_reason = str(e)
                failed.append(EngineCoreOutput.ended(request))
        return failed

    def step(self) -> list[EngineCoreOutput]:
        if self.dead is not None:
            raise EngineError(self.dead)
        failed = self._admit_compiled() if self.compiling else []
        try:
            scheduler_output = self.scheduler.schedule()
        except Exception as e:
            raise self._stop(e, "schedule") from None
        for observe in self.schedule_observers:
            observe(scheduler_output)
        try:
            result = self.runner.execute(scheduler_output)
        except Exception as e:
            raise self._stop(e, "execute") from None
        outputs = self.scheduler.update_from_output(scheduler_output, result.sampled_token_ids, result.logprobs,
                                                    result.spec_outputs, result.prompt_logprobs, result.pooled)
        if self.speculator is not None:
            self.speculator.forget_finished(scheduler_output.finished_request_ids,
                                            [o.request_id for o in outputs if o.finish_reason is not None])
            try:
                self.speculator.propose(self.scheduler.running)
            except EngineError as e:
                raise self._stop(e, "propose") from None
        if self.lora is not None and self.lora.removed:  # unloaded adapters whose last request ended
            self.lora.trim()
        stats = self.stats
        stats.num_steps += 1
        stats.num_preemptions += len(scheduler_output.preempted_request_ids)
        stats.kv_usage = self.kv_cache_manager.usage
        stats.peak_kv_usage = max(stats.peak_kv_usage, stats.kv_usage)
        for request in scheduler_output.rejected:  # turned away by the policy before running
            outputs.append(EngineCoreOutput.ended(request))
        for request in scheduler_output.failed:  # a policy call failed on it
            outputs.append(EngineCoreOutput.ended(request))
        return failed + outputs if failed else outputs

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks, if any, and the compile threads; idempotent."""
        self.structured_output.shutdown()
        if self.tp_ranks is not None:
            self.tp_ranks.shutdown()

    def snapshot_stats(self) -> CoreStats:
        stats = self.stats
        stats.num_running = len(self.scheduler.running)
        stats.num_waiting = len(self.scheduler.waiting)
        stats.kv_usage = self.kv_cache_manager.usage
        prefix = self.kv_cache_manager.prefix_cache_stats
        stats.prefix_cache_queries, stats.prefix_cache_hits = prefix.queries, prefix.hits
        if self.speculator is not None:
            spec = self.speculator.stats
            stats.spec_decode_num_drafts = spec.num_drafts
            stats.spec_decode_num_draft_tokens = spec.num_draft_tokens
            stats.spec_decode_num_accepted_tokens = spec.num_accepted_tokens
        return stats

