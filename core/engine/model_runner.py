"""Runs one scheduled step on the model: flatten the batch, forward, sample.

Flattening: requests are ordered by query length, shortest first (decodes, then speculative
verifications and short chunks, then long chunks; equal lengths keep their order). For each
scheduled request the tokens ``all_token_ids[num_computed : num_computed + num_new]`` are
laid end to end in ``input_ids`` with their ``positions``; ``query_start_loc`` holds the running
sum of query lengths, ``seq_lens`` the context after this step, ``block_table`` one padded row per
request and ``slot_mapping`` the cache slot of every new token. Logits are computed only at the
last token of requests whose known tokens are all computed after this step (``is_sampled``).

The block tables live in a persistent batch (``paged.core.engine.input_batch.InputBatch``): one
row per request the runner holds, written once when the request is admitted (the scheduler sends
its full block list), appended with the new block ids of later steps (mostly none), freed when it
finishes or is preempted (the last row moves into the hole). A step's Python work is
O(requests + new tokens); its block table (a gather of the scheduled rows), positions and slot
mapping are vectorised numpy over those rows, never a per-request copy of the blocks held.

Prompt logprobs: a request that asks for them (``Request.prompt_logprobs``) gets logits at each
prompt position of its chunk whose logprob it does not have yet (the logits at position p give
the logprob of prompt token p + 1); those rows follow the sampled rows in ``logits_rows`` and go
through the LM head in slices of ``PROMPT_LOGITS_SLICE`` rows, so a long chunk never holds a
whole ``[chunk, vocab]`` logits tensor.

Under tensor parallelism every rank has a runner over its share of the model and of the KV
heads; the scheduler and the sampler exist on rank 0 only. Rank 0 flattens the step into
``StepInputs``, broadcasts them (one packed int64 array over the gloo group), and every rank
runs the same forward; rank 0 receives the gathered logits and samples. The other ranks sit in
``run_worker_loop`` until rank 0 broadcasts the stop sentinel.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from paged.core.attention import AttentionLayout, BatchInputs, kv_sliding_window
from paged.core.config import EngineConfig, ResolvedPlugins
from paged.core.engine.compiled_step import CompiledForward, OpaqueAttention
from paged.core.engine.distributed import get_tp, shard_heads
from paged.core.engine.input_batch import InputBatch
from paged.core.engine.pooling import PoolingRows, is_head_weight
from paged.core.utils import cdiv
from paged.core.engine.sampler import Sampler, SamplerOutput, token_logprobs
from paged.core.engine.spec_decode import DraftRow, accepted_tokens, draft_rows
from paged.core.engine.scheduler import SchedulerOutput
from paged.core.errors import ConfigError
from paged.core.loading.loader import build_model
from paged.core.loading.model_config import ResolvedModel

logger = logging.getLogger("paged")


def resolve_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: 'cuda' was asked for but no CUDA GPU is available; use 'cpu' or 'auto'")
    return torch.device(setting)


@dataclass
class StepResult:
    sampled_token_ids: dict[str, int]
    logprobs: dict[str, object]
    # requests that verified drafts: (accepted tokens with the last sampled one, their logprobs or None)
    spec_outputs: dict[str, tuple[list[int], list | None]] | None = None
    # requests that asked for prompt logprobs: this step's new entries, in prompt order
    prompt_logprobs: dict[str, list] | None = None
    # the pooling runner: the requests whose prompt was computed this step, their vectors (float32 bytes)
    pooled: dict[str, bytes] | None = None


# num_reqs, num_tokens, num_decodes, max_blocks, num_logits_rows, num_prompt_rows, num_lora_loads, has_lora_slots
_HEADER = 8
_NO_LORA_LOADS = np.zeros((0, 2), dtype=np.int64)
PROMPT_LOGITS_SLICE = 512  # prompt-logprob rows through the LM head at once


@dataclass
class StepInputs:
    """Everything a rank needs for one forward, as host arrays: the flat tokens, the batch layout
    (see BatchInputs) and the hidden-state rows whose logits are sampled."""

    num_decodes: int
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    query_start_loc: np.ndarray  # [num_reqs + 1] int32
    seq_lens: np.ndarray  # [num_reqs] int32
    block_table: np.ndarray  # [num_reqs, max_blocks] int32
    slot_mapping: np.ndarray  # [num_tokens] int64
    logits_rows: np.ndarray  # [num_sampled + num_prompt_rows] int64
    num_draft_rows: int = 0  # of logits_rows, those at draft tokens (rank 0 only: not broadcast)
    num_prompt_rows: int = 0  # the last rows of logits_rows: prompt-logprob rows
    # LoRA (paged.core.engine.lora_manager): each token's adapter slot (-1: none), None when no
    # token has one; the adapters to copy into slots first, [[slot, lora_int_id], ...]
    lora_token_slots: np.ndarray | None = None
    lora_loads: np.ndarray = field(default_factory=lambda: _NO_LORA_LOADS)

    def pack(self) -> np.ndarray:
        """One int64 array: an 8-number header, then the arrays in field order."""
        num_reqs, max_blocks = self.block_table.shape
        has_slots = self.lora_token_slots is not None
        header = [num_reqs, len(self.input_ids), self.num_decodes, max_blocks, len(self.logits_rows),
                  self.num_prompt_rows, len(self.lora_loads), int(has_slots)]
        parts = [self.input_ids, self.positions, self.query_start_loc, self.seq_lens,
                 self.block_table.reshape(-1), self.slot_mapping, self.logits_rows, self.lora_loads.reshape(-1)]
        if has_slots:
            parts.append(self.lora_token_slots)
        return np.concatenate([np.asarray(header, dtype=np.int64)] + [np.asarray(p, dtype=np.int64) for p in parts])

    @classmethod
    def unpack(cls, packed: np.ndarray) -> "StepInputs":
        (num_reqs, num_tokens, num_decodes, max_blocks, num_logits, num_prompt, num_loads,
         has_slots) = (int(x) for x in packed[:_HEADER])
        sizes = [num_tokens, num_tokens, num_reqs + 1, num_reqs, num_reqs * max_blocks, num_tokens, num_logits,
                 2 * num_loads]
        ids, pos, qsl, seq, table, slots, rows, loads, lora_slots = np.split(packed[_HEADER:], np.cumsum(sizes))
        return cls(num_decodes, ids, pos, qsl.astype(np.int32), seq.astype(np.int32),
                   table.astype(np.int32).reshape(num_reqs, max_blocks), slots, rows, num_prompt_rows=num_prompt,
                   lora_token_slots=lora_slots.astype(np.int32) if has_slots else None,
                   lora_loads=loads.reshape(num_loads, 2))


def _num_new_tokens(scheduled) -> int:
    return scheduled.num_new_tokens


class ModelRunner:
    pooling = None  # the pooling runner's PoolingSetup (paged.core.engine.pooling), set by the engine core
    lora = None  # the LoRA adapters' slots (paged.core.engine.lora_manager.LoRAManager) with lora.enable_lora

    def __init__(self, config: EngineConfig, plugins: ResolvedPlugins, model: ResolvedModel, device: torch.device,
                 registry=None) -> None:
        """Build this rank's share of ``model`` (resolved beforehand, see
        ``paged.core.loading.model_config``) around the attention backend, quantize its weights
        (``model.quantization``, methods from ``registry``), then size and allocate the KV cache."""
        self.config = config
        self.device = device
        self.model_config = model
        self.dtype = model.dtype
        self.max_model_len = model.max_model_len
        self.vocab_size = model.vocab_size
        self.block_size = config.cache.block_size
        num_layers, num_heads, num_kv_heads, head_dim = model.attention_shape
        self.tp = get_tp()
        # Every rank checks every rank's share, so an impossible split fails alike everywhere,
        # before any collective. The model's layers split the heads the same way.
        heads = [shard_heads(num_heads, num_kv_heads, r, self.tp.size) for r in range(self.tp.size)][self.tp.rank]
        self.layout = AttentionLayout(
            num_layers, heads.num_heads, heads.num_kv_heads, head_dim, self.block_size, self.dtype, device
        )
        self.backend = plugins.attention.factory(self.layout, plugins.attention_options)
        compile_steps = config.model.compile and self._can_compile()
        # Compiled, the model holds an OpaqueAttention: attention through a custom op dynamo does not trace.
        model_backend = OpaqueAttention(self.backend) if compile_steps else self.backend
        self.model = build_model(model.model_dir, model.hf_config, model.spec.factory, model_backend, self.dtype, device,
                                 skip_weights=is_head_weight if model.classification_head else None)
        # every layer windowed: the KV manager frees the blocks out of the largest window
        self.kv_sliding_window = kv_sliding_window(self.model, num_layers)
        # LoRA slots first: the layers' checkpoint shapes are read before quantization releases the weights
        if config.lora.enable_lora:
            self.lora = self._lora_manager(config, registry, device)
        self._quantize(config, registry, device)
        prepack = getattr(self.model, "prepack_weights", None)
        if prepack is not None and device.type == "cpu" and self.dtype == torch.bfloat16 and config.model.cpu_prepack_weights:
            prepack()
        self._log_weight_memory(config.model.dtype)
        self.sampler = Sampler(self.vocab_size, device) if self.tp.is_first else None
        self.pooling_rows = PoolingRows()  # the pooling runner's (rank 0)

        self.num_blocks = self._agree_on_num_blocks(self._determine_num_blocks())
        self.kv_caches = self.backend.allocate_kv_cache(self.num_blocks)
        self.forward_model = self.model  # (input_ids, positions, kv_caches, metadata) -> hidden
        if compile_steps:
            compiled = CompiledForward(self.model, config.model.compile_max_tokens)
            self.forward_model = compiled
            seconds = compiled.warm_up(self._dummy_forward)
            logger.info("model.compile: %s in %.1f s (steps of up to %d tokens)",
                        "eager fallback" if compiled.failed else "compiled", seconds, compiled.max_tokens)
        self.max_blocks_per_req = cdiv(self.max_model_len, self.block_size)
        # Rank 0 only reads it (the other ranks get each step's table in the broadcast).
        self.input_batch = InputBatch(config.scheduler.max_num_seqs, self.max_blocks_per_req)
        capacity = self.num_blocks * self.block_size
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s); max concurrency at max_model_len "
            "%d: %.2fx",
            self.num_blocks,
            self.block_size,
            capacity,
            self.num_blocks * self.layout.bytes_per_block / 2**30,
            str(self.dtype).removeprefix("torch."),
            self.max_model_len,
            capacity / self.max_model_len,
        )

    def _can_compile(self) -> bool:
        if self.tp.size > 1:  # the layers' collectives would be traced too: not measured, not supported
            logger.warning("model.compile: not used with tensor parallelism (%d ranks); running eager", self.tp.size)
            return False
        if self.config.lora.enable_lora:  # the layers add adapters in place, step by step: not traced
            logger.warning("model.compile: not used with LoRA adapters (lora.enable_lora); running eager")
            return False
        return True

    def _lora_manager(self, config: EngineConfig, registry, device: torch.device):
        """The adapter slots on the model's linear layers (paged.core.engine.lora_manager)."""
        from paged.core.engine.lora_manager import LoRAManager, resolve_lora_kernel

        if registry is None:
            from paged.core.registry import get_registry

            registry = get_registry()
        spec, kernel = resolve_lora_kernel(config, registry, device, self.dtype)
        manager = LoRAManager(self.model, config, kernel, self.dtype, device, self.tp)
        lora = config.lora
        logger.info("LoRA: kernel %r, %d slot(s) of rank %d on %d layers (%.1f MiB), %d adapters kept in memory",
                    spec.name, lora.max_loras, lora.max_lora_rank, len(manager.layers), manager.slot_bytes / 2**20,
                    lora.cpu_loras)
        return manager

    @torch.inference_mode()
    def _dummy_forward(self, num_tokens: int) -> None:
        """One ``num_tokens``-token prefill through ``forward_model`` into the first blocks (at
        start-up, before any request holds them)."""
        batch, input_ids, positions = self._dummy_batch([num_tokens], [list(range(cdiv(num_tokens, self.block_size)))])
        self.forward_model(input_ids, positions, self.kv_caches, self.backend.build_metadata(batch))

    def _quantize(self, config: EngineConfig, registry, device: torch.device) -> None:
        from paged.core.loading.quantize import make_quantizer

        if registry is None:
            from paged.core.registry import get_registry

            registry = get_registry()
        self.quantizer = make_quantizer(config.model, registry, self.model_config.model_dir, device, self.dtype)
        if self.quantizer is None:
            return
        if not hasattr(self.model, "quantize_weights"):
            raise ConfigError(
                f"model.quantization: the {type(self.model).__name__} implementation has no quantize_weights; "
                "use model.quantization=none"
            )
        count = self.model.quantize_weights(self.quantizer)
        counts = self.quantizer.counts
        shared = count - sum(counts.values())  # modules that reuse a weight quantized once (a tied LM head)
        logger.info("quantized %d weights (%s) for %d modules%s%s", sum(counts.values()),
                    ", ".join(f"{n}: {c}" for n, c in sorted(counts.items())) or "none", count,
                    f"; {shared} share a weight quantized once (tied embedding and LM head)" if shared > 0 else "",
                    f"; left dense by the method: {', '.join(self.quantizer.left_dense)}" if self.quantizer.left_dense else "")

    def _log_weight_memory(self, dtype_setting: str) -> None:
        measure = getattr(self.model, "weight_bytes", None)
        self.weight_bytes = int(measure()) if measure else sum(p.numel() * p.element_size() for p in self.model.parameters())
        logger.info("weights: %.1f MiB held (dtype %s%s)", self.weight_bytes / 2**20,
                    str(self.dtype).removeprefix("torch."), ", chosen by dtype=auto" if dtype_setting == "auto" else "")

    # --- KV cache sizing ----------------------------------------------------------------
    def _determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        per_block = self.layout.bytes_per_block
        if self.device.type == "cuda":
            budget = self._profile_gpu_kv_budget()
        else:
            budget = int((cache.kv_cache_memory_gib or 1.0) * 2**30)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ConfigError(
                f"cache: the KV budget ({budget / 2**30:.3f} GiB) is smaller than one block "
                f"({per_block} bytes); raise kv_cache_memory_gib or gpu_memory_utilization"
            )
        return int(num_blocks)

    def _agree_on_num_blocks(self, num_blocks: int) -> int:
        """Every rank must hold the same block ids: the smallest count any rank can afford."""
        if self.tp.size == 1:
            return num_blocks
        count = torch.tensor([num_blocks], dtype=torch.int64)
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MIN, group=self.tp.cpu_group)
        return int(count.item())

    def _profile_gpu_kv_budget(self) -> int:
        """gpu_memory_utilization x total - weights - peak activation of a dummy forward at the
        largest batch (max_num_batched_tokens tokens)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        num_seqs = max(1, min(self.config.scheduler.max_num_seqs, num_tokens))
        blocks_needed = num_seqs * cdiv(cdiv(num_tokens, num_seqs), self.block_size)
        scratch = self.backend.allocate_kv_cache(blocks_needed)
        scratch_bytes = blocks_needed * self.layout.bytes_per_block
        lengths = [num_tokens // num_seqs + (1 if i < num_tokens % num_seqs else 0) for i in range(num_seqs)]
        ids, next_block = [], 0
        for n in lengths:
            nb = cdiv(n, self.block_size)
            ids.append(list(range(next_block, next_block + nb)))
            next_block += nb
        batch, input_ids, positions = self._dummy_batch(lengths, ids)
        with torch.inference_mode():
            metadata = self.backend.build_metadata(batch)
            hidden = self.model(input_ids, positions, scratch, metadata)
            self.model.compute_logits(hidden[batch.query_start_loc[1:].long() - 1])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - scratch_bytes
        del scratch, hidden
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = int(self.config.cache.gpu_memory_utilization * total - peak)
        logger.info(
            "GPU memory: total %.1f GiB, weights + peak activation %.2f GiB, KV budget %.2f GiB",
            total / 2**30, peak / 2**30, budget / 2**30,
        )
        return budget

    def _dummy_batch(self, lengths: list[int], block_ids: list[list[int]]):
        tokens = sum(lengths)
        input_ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(self.device)
        table = np.zeros((len(lengths), max(len(b) for b in block_ids)), dtype=np.int32)
        slots = []
        for i, (n, ids) in enumerate(zip(lengths, block_ids)):
            table[i, : len(ids)] = ids
            pos = np.arange(n)
            slots.append(np.asarray(ids)[pos // self.block_size] * self.block_size + pos % self.block_size)
        qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        seq_lens = np.asarray(lengths, dtype=np.int32)
        return self._to_batch(len(lengths), tokens, 0, qsl, seq_lens, table, np.concatenate(slots)), input_ids, positions

    def _to_batch(self, num_reqs, num_tokens, num_decodes, qsl, seq_lens, table, slots) -> BatchInputs:
        dev = self.device
        qsl_cpu = torch.from_numpy(qsl)
        seq_cpu = torch.from_numpy(seq_lens)
        return BatchInputs(
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            num_decodes=num_decodes,
            max_query_len=int((qsl[1:] - qsl[:-1]).max()) if num_reqs else 0,
            max_seq_len=int(seq_lens.max()) if num_reqs else 0,
            query_start_loc=qsl_cpu.to(dev, non_blocking=True),
            seq_lens=seq_cpu.to(dev, non_blocking=True),
            block_table=torch.from_numpy(np.ascontiguousarray(table)).to(dev, non_blocking=True),
            slot_mapping=torch.from_numpy(slots.astype(np.int64)).to(dev, non_blocking=True),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_cpu,
        )

    # --- one step -----------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> StepResult:
        if output.finished_request_ids:
            self.sampler.forget(output.finished_request_ids)
        removed = output.preempted_request_ids + output.finished_request_ids
        self.input_batch.update(removed, output.scheduled)
        if self.pooling is not None and removed:
            self.pooling_rows.drop(removed)
        if not output.scheduled:
            return StepResult({}, {})
        inputs, sample_requests, prompt_groups, pool_items = self._prepare_inputs(output)
        if self.tp.size > 1:
            self.tp.broadcast_array(inputs.pack())
        prompt_logprobs = _PromptLogprobs(prompt_groups) if prompt_groups else None
        logits, hidden = self._forward(inputs, prompt_logprobs)
        if pool_items:
            return StepResult({}, {}, pooled=self._pool(pool_items, inputs, hidden, logits))
        prompt_out = prompt_logprobs.by_request() if prompt_logprobs is not None else None
        if not sample_requests:
            return StepResult({}, {}, prompt_logprobs=prompt_out)
        sampled: SamplerOutput = self.sampler.sample(logits, sample_requests)
        if inputs.num_draft_rows:
            result = self._verified(sample_requests, sampled)
            result.prompt_logprobs = prompt_out
            return result
        token_ids = {r.request_id: t for r, t in zip(sample_requests, sampled.token_ids)}
        logprobs = {r.request_id: lp for r, lp in zip(sample_requests, sampled.logprobs) if lp is not None}
        return StepResult(token_ids, logprobs, prompt_logprobs=prompt_out)

    def _pool(self, items: list, inputs: StepInputs, hidden: torch.Tensor, logits: torch.Tensor | None) -> dict[str, bytes]:
        """Keep the rows an every-token pooler reads; pool the requests whose prompt is done: the
        pooler once for all of them, the classifier tokens' logits (the logits rows are exactly
        those requests, in order), or the checkpoint's score head once for all of them."""
        setup = self.pooling
        keep_all = setup.needs_all_tokens
        qsl = inputs.query_start_loc
        ready_ids, ready_rows = [], []
        for s, i in items:
            request_id = s.request.request_id
            start, end = int(qsl[i]), int(qsl[i + 1])
            if keep_all:
                self.pooling_rows.add(request_id, hidden[start:end])
            if s.is_sampled:
                ready_ids.append(request_id)
                ready_rows.append(self.pooling_rows.take(request_id) if keep_all else hidden[end - 1:end].float())
        if not ready_ids:
            return {}
        if setup.classifier_token_ids is not None:
            vectors = list(logits[:, setup.classifier_token_ids].float())
        elif setup.head_weight is not None:  # the checkpoint's score head on the last tokens' states
            vectors = list(torch.nn.functional.linear(torch.cat(ready_rows), setup.head_weight, setup.head_bias))
        else:
            vectors = setup.pooler.pool(ready_rows)
            if len(vectors) != len(ready_ids) or any(not isinstance(v, torch.Tensor) or v.dim() != 1 for v in vectors):
                raise TypeError(f"pooler {setup.name!r}: pool() must return one 1-d tensor per request "
                                f"({len(ready_ids)} here), got {type(vectors).__name__} of "
                                f"{[tuple(getattr(v, 'shape', ())) for v in vectors][:4]}")
        return {r: v.detach().to("cpu", torch.float32).contiguous().numpy().tobytes() for r, v in zip(ready_ids, vectors)}

    @staticmethod
    def _verified(rows: list, sampled: SamplerOutput) -> StepResult:
        """Split the sampled rows into plain requests' tokens and the accepted tokens of those
        that verified drafts (``paged.core.engine.spec_decode``: a request's rows are consecutive,
        row 0 the request itself, then one ``DraftRow`` per draft)."""
        token_ids, logprobs, spec_outputs = {}, {}, {}
        i, num = 0, len(rows)
        while i < num:
            request = rows[i]
            j = i + 1
            while j < num and type(rows[j]) is DraftRow:
                j += 1
            if j == i + 1:
                token_ids[request.request_id] = sampled.token_ids[i]
                if sampled.logprobs[i] is not None:
                    logprobs[request.request_id] = sampled.logprobs[i]
            else:
                accepted = accepted_tokens(rows[j - 1].drafts, sampled.token_ids[i:j])
                lps = sampled.logprobs[i:i + len(accepted)] if sampled.logprobs[i] is not None else None
                spec_outputs[request.request_id] = (accepted, lps)
            i = j
        return StepResult(token_ids, logprobs, spec_outputs)

    def _prepare_inputs(self, output: SchedulerOutput) -> tuple[StepInputs, list, list, list]:
        """Flatten the scheduled requests (decodes first), every one held by ``input_batch``;
        also the requests sampled this step, in the order of ``logits_rows``, the prompt-logprob
        groups (request, first logits position, count) in the order of the prompt rows, and the
        pooling requests (scheduled, index in the flattened order)."""
        # shortest queries first (decodes, then verifications and short chunks; stable among equals):
        # backends take decodes first, and the CPU kernel takes the short queries after them too
        order = sorted(output.scheduled, key=_num_new_tokens)
        num_reqs = len(order)
        row_of = self.input_batch.row_of
        # The one per-request Python pass: what only the scheduler's objects know.
        rows, starts, query_lens, token_ids = [], [], [], []
        sample_index: list[int] = []
        sample_requests = []
        draft_logits_rows: list[int] | None = None  # with drafts: every logits row, in order
        pool_items: list = []
        wants_prompt_logprobs: list[int] = []  # indices of requests still owed prompt logprobs
        classify = self.pooling is not None and self.pooling.classifier_token_ids is not None
        lora_ids: list[int] | None = [] if self.lora is not None else None
        for i, s in enumerate(order):
            request = s.request
            start, n = s.num_computed_tokens, s.num_new_tokens
            rows.append(row_of[request.request_id])
            if lora_ids is not None:
                lora_ids.append(request.lora_int_id)
            starts.append(start)
            query_lens.append(n)
            if n == 1:
                token_ids.append(request.all_token_ids[start])
            elif s.spec_token_ids:  # the last known token, then the drafts: logits at each
                token_ids.append(request.all_token_ids[start])
                token_ids.extend(s.spec_token_ids)
                if draft_logits_rows is None:
                    draft_logits_rows = []
            else:
                token_ids.extend(request.all_token_ids[start : start + n])
            if request.prompt_logprobs is not None and start < request.num_prompt_tokens - 1:  # (a 1-token chunk too)
                wants_prompt_logprobs.append(i)
            if request.pooling_params is not None:  # never sampled: pooled when its prompt is done
                pool_items.append((s, i))
                if s.is_sampled and classify:
                    sample_index.append(i)
            elif s.is_sampled:
                if s.spec_token_ids:
                    sample_requests.extend(draft_rows(request, s.spec_token_ids))
                else:
                    sample_requests.append(request)
                sample_index.append(i)
        rows_arr = np.array(rows, dtype=np.int64)
        starts_arr = np.array(starts, dtype=np.int64)
        lens_arr = np.array(query_lens, dtype=np.int32)
        qsl = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(lens_arr, out=qsl[1:])
        num_tokens = int(qsl[-1])
        num_decodes = int(np.count_nonzero(lens_arr == 1))
        if num_tokens == num_reqs:  # decodes only: one token per request, at its first new position
            positions, token_rows = starts_arr, rows_arr
        else:
            # token t of request i sits at starts[i] + (t - qsl[i])
            positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts_arr - qsl[:-1], lens_arr)
            token_rows = np.repeat(rows_arr, lens_arr)
        inputs = StepInputs(
            num_decodes=num_decodes,
            input_ids=np.array(token_ids, dtype=np.int64),
            positions=positions,
            query_start_loc=qsl,
            seq_lens=(starts_arr + lens_arr).astype(np.int32),
            block_table=self.input_batch.gather_block_table(rows_arr),
            slot_mapping=self.input_batch.slot_mapping(token_rows, positions, self.block_size),
            logits_rows=qsl[1:][sample_index].astype(np.int64) - 1,
        )
        if lora_ids is not None and any(lora_ids):
            slots, inputs.lora_loads = self.lora.prepare_step(lora_ids)
            inputs.lora_token_slots = np.repeat(slots, lens_arr)
        if draft_logits_rows is not None:
            num_draft_rows = 0
            for i in sample_index:
                k = len(order[i].spec_token_ids)
                end = int(qsl[i + 1])
                draft_logits_rows.extend(range(end - 1 - k, end))
                num_draft_rows += k
            inputs.logits_rows = np.array(draft_logits_rows, dtype=np.int64)
            inputs.num_draft_rows = num_draft_rows
        prompt_groups = []
        prompt_rows: list[np.ndarray] = []
        for i in wants_prompt_logprobs:
            s = order[i]
            done = s.request.prompt_logprobs
            # logits at position p give prompt token p + 1's logprob; those not made yet (a
            # request that wants them never starts past them: no prefix-cache hit)
            start = s.num_computed_tokens
            first = max(start, len(done))
            end = min(start + s.num_new_tokens, s.request.num_prompt_tokens - 1)
            if first < end:
                prompt_groups.append((s.request, first, end - first))
                prompt_rows.append(np.arange(first - start, end - start, dtype=np.int64) + int(qsl[i]))
        if prompt_rows:
            rows = np.concatenate(prompt_rows)
            inputs.logits_rows = np.concatenate([inputs.logits_rows, rows])
            inputs.num_prompt_rows = len(rows)
        return inputs, sample_requests, prompt_groups, pool_items

    def _forward(self, inputs: StepInputs, prompt_logprobs: "_PromptLogprobs | None" = None
                 ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The model on this rank's share: the sampled rows' logits (rank 0; else None) and the
        final hidden states of every token. The prompt
        rows' logits go, slice by slice, to ``prompt_logprobs`` (rank 0; every rank runs the
        same LM-head calls, a collective under tensor parallelism)."""
        num_reqs = len(inputs.seq_lens)
        batch = self._to_batch(
            num_reqs, len(inputs.input_ids), inputs.num_decodes, inputs.query_start_loc, inputs.seq_lens,
            inputs.block_table, inputs.slot_mapping,
        )
        input_ids = torch.from_numpy(inputs.input_ids).to(self.device)
        positions = torch.from_numpy(inputs.positions).to(self.device)
        metadata = self.backend.build_metadata(batch)
        lora = self.lora
        if lora is not None:
            lora.begin_step(inputs.lora_token_slots, inputs.lora_loads)
        try:
            hidden = self.forward_model(input_ids, positions, self.kv_caches, metadata)
        finally:
            if lora is not None:
                lora.end_step()
        rows = torch.from_numpy(inputs.logits_rows).to(self.device)
        num_sampled = len(rows) - inputs.num_prompt_rows
        for first in range(num_sampled, len(rows), PROMPT_LOGITS_SLICE):
            part = self.model.compute_logits(hidden[rows[first:first + PROMPT_LOGITS_SLICE]])
            if prompt_logprobs is not None and part is not None:
                prompt_logprobs.add(part)
        if not num_sampled:
            return None, hidden
        return self.model.compute_logits(hidden[rows[:num_sampled]]), hidden

    @torch.inference_mode()
    def run_worker_loop(self) -> None:
        """Ranks other than 0: run each step rank 0 broadcasts, until it broadcasts the stop."""
        while (packed := self.tp.broadcast_array(None)) is not None:
            if packed[0] < 0:  # rank 0 added or removed a LoRA adapter (paged.core.engine.lora_manager)
                self.lora.handle_control(packed)
                continue
            self._forward(StepInputs.unpack(packed))


class _PromptLogprobs:
    """Collects one step's prompt logprobs from the LM head's slices of prompt rows: for each row
    the logprob and rank of the prompt's next token and the request's top-k, from the raw logits'
    ``log_softmax`` (no sampling settings apply, as in vLLM)."""

    def __init__(self, groups: list) -> None:
        self.groups = groups  # (request, first logits position, count), in row order
        self.targets: list[int] = []  # the prompt token each row's logits predict
        self.ks: list[int] = []
        for request, first, count in groups:
            self.targets.extend(request.prompt_token_ids[first + 1:first + 1 + count])
            self.ks.extend([request.sampling_params.prompt_logprobs] * count)
        self.entries: list = []

    def add(self, logits: torch.Tensor) -> None:
        begin = len(self.entries)
        targets = torch.tensor(self.targets[begin:begin + logits.shape[0]], device=logits.device)
        ks = self.ks[begin:begin + logits.shape[0]]
        self.entries.extend(token_logprobs(torch.log_softmax(logits.float(), dim=-1), targets, ks))

    def by_request(self) -> dict[str, list]:
        out, at = {}, 0
        for request, _first, count in self.groups:
            out[request.request_id] = self.entries[at:at + count]
            at += count
        return out
