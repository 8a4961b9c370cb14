"""The offline API: ``LLM(model=None, **settings).generate(...)`` / ``.chat(...)``; with
``runner="pooling"``, ``.embed(...)`` / ``.encode(...)`` / ``.score(...)``."""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from paged.core.config import EngineConfig, Flag, config_flags, load_config
from paged.core.frontend.llm_engine import LLMEngine
from paged.core.errors import ConfigError, EngineError, InvalidRequestError
from paged.core.frontend.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput, RequestOutputKind
from paged.core.frontend.scoring import NOT_A_CLASSIFIER, classifier_prompts, cosine_scores, pair_up
from paged.core.frontend.tools import (calls_from_constrained, check_tools, model_type, tool_choice_mode,
                                       tool_constraint, tool_parser_for)
from paged.core.lora import LoRARequest
from paged.core.pooling_params import PoolingParams
from paged.core.sampling_params import SamplingParams


def settings_to_overrides(settings: dict[str, Any]) -> dict[str, Any]:
    """Map keyword settings to the nested config: a section name takes a dict
    (``scheduler={"policy": "priority"}``); any field or flag name of a section is accepted flat
    (``max_num_seqs=8``, ``policy="priority"``, ``enable_prefix_caching=False``)."""
    by_name = {}
    for flag in config_flags():
        for name in {flag.field, flag.name.replace("-", "_")}:
            by_name.setdefault(name, flag)  # a field name two sections share keeps its first owner
    by_name["policy_options"] = Flag("policy-options", "scheduler", "policy_options", dict, "")
    by_name["attention_options"] = Flag("attention-options", "attention", "options", dict, "")
    by_name["structured_output_options"] = Flag("structured-output-options", "structured_output", "options", dict, "")
    by_name["quantization_options"] = Flag("quantization-options", "model", "quantization_options", dict, "")
    sections = {n for n, f in EngineConfig.model_fields.items() if n != "device"}
    out: dict[str, Any] = {}
    for key, value in settings.items():
        if key == "speculative_config":  # vLLM's name for the section
            key = "speculative"
            if value is None:  # vLLM's default: no speculation (whatever a config file says)
                value = {"method": None}
        if key in sections and isinstance(value, dict):
            out.setdefault(key, {}).update(value)
        elif key in by_name:
            flag = by_name[key]
            if flag.section is None:
                out[flag.field] = value
            else:
                out.setdefault(flag.section, {})[flag.field] = value
        else:
            raise ConfigError(f"{key}: unknown setting; see `paged config` for the accepted names")
    return out


class LLM:
    def __init__(self, model: str | None = None, *, config_file: str | None = None, **settings: Any) -> None:
        if model is not None:
            settings["model"] = str(model)
        self.config = load_config(config_file, settings_to_overrides(settings))
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate``/``chat`` use when given no SamplingParams: SamplingParams' defaults
        with the fields the model's generation_config.json sets (e.g. SmolLM2's temperature 0.2,
        top_p 0.9) in their place. An explicit SamplingParams is used as given."""
        return SamplingParams(**self.engine.default_sampling)

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor-parallel ranks); also done at exit."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        tenant: str | Sequence[str | None] | None = None,
        deadline_s: float | Sequence[float | None] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, or token ids); outputs come back in input order.
        ``tenant`` (who sends it) and ``deadline_s`` (seconds to finish) are for the scheduling
        policy: one value, or one per prompt. ``lora_request``: the LoRA adapter to run with
        (``LoRARequest(name, id, path)``, with ``enable_lora=True``), one for all or one per prompt
        (None: the base model); prompts of different adapters run in the same steps. A request the
        policy's admission control turns away
        raises RequestRejectedError when it arrives, or finishes with finish_reason "rejected".
        A request a plugin failed on (paged.core.engine.plugin_faults) raises EngineError naming
        the plugin, its method and the exception, with every output in ``.outputs``."""
        prompt_list = _as_prompt_list(prompts)
        n = len(prompt_list)
        params_list = _broadcast(sampling_params or self.get_default_sampling_params(), n, "sampling_params")
        priorities = _broadcast(priority if priority is not None else 0, n, "priority")
        metadata = list(zip(_broadcast(tenant, n, "tenant"), _broadcast(deadline_s, n, "deadline_s")))
        loras = _broadcast(lora_request, n, "lora_request")
        return self._run(prompt_list, params_list, priorities, use_tqdm, add_special_tokens=True, metadata=metadata,
                         loras=loras)

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        use_tqdm: bool = True,
        chat_template_kwargs: dict | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, through the
        model's chat template. ``tools`` (OpenAI function tools) and ``tool_choice`` ("auto", the
        default with tools; "none"; "required"; or {"type": "function", "function": {"name": ...}})
        work as on the server: the template receives the tools, "required" and a named function are
        enforced by a JSON-schema constraint, and each output's ``tool_calls`` holds the parsed calls
        (``ToolCall``: ``name``, JSON ``arguments``, ``id``); ``text`` stays the model's raw output.
        ``chat_template_kwargs``: more variables for the template, e.g. ``{"enable_thinking": False}``.
        ``lora_request``: as in ``generate``."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tools = check_tools(tools) if tools is not None else None
        mode, name = tool_choice_mode(tool_choice, tools)
        shown_tools = tools if mode != "none" else None
        prompts = [self.engine.apply_chat_template(list(c), shown_tools, chat_template_kwargs) for c in conversations]
        params_list = _broadcast(sampling_params or self.get_default_sampling_params(), len(prompts), "sampling_params")
        forced = tool_constraint(mode, name, tools, parallel=True) if tools else None
        if forced is not None:
            if any(p.structured_output is not None for p in params_list):
                raise InvalidRequestError(f"tool_choice: {tool_choice!r} cannot be combined with "
                                          "sampling_params.structured_output")
            self.engine.input_processor.validate_structured_output(forced)
            params_list = [p.copy(structured_output=forced) for p in params_list]
        outputs = self._run(prompts, params_list, [0] * len(prompts), use_tqdm, add_special_tokens=False,
                            loras=_broadcast(lora_request, len(prompts), "lora_request"))
        if shown_tools:
            parser = tool_parser_for(model_type(self.engine.model_info.model_dir))
            for output in outputs:
                for c in output.outputs:
                    c.tool_calls = _tool_calls(mode, name, parser, c)
        return outputs

    def _run(self, prompts, params_list, priorities, use_tqdm: bool, add_special_tokens: bool,
             metadata=None, loras=None) -> list[RequestOutput]:
        engine = self.engine
        ids = []
        metadata = metadata or [(None, None)] * len(prompts)
        loras = loras or [None] * len(prompts)
        try:
            for prompt, params, prio, (tenant, deadline_s), lora in zip(prompts, params_list, priorities, metadata,
                                                                        loras):
                ids.append(engine.add_request(None, prompt, params, priority=prio, add_special_tokens=add_special_tokens,
                                              tenant=tenant, deadline_s=deadline_s,
                                              output_kind=RequestOutputKind.FINAL_ONLY, lora_request=lora))
        except Exception:
            engine.abort_request(ids)
            raise
        bar = _progress(len(ids)) if use_tqdm else None
        in_tokens = out_tokens = 0
        start = time.perf_counter()

        def progress(output: RequestOutput) -> None:
            nonlocal in_tokens, out_tokens
            in_tokens += len(output.prompt_token_ids)
            out_tokens += sum(len(c.token_ids) for c in output.outputs)
            elapsed = time.perf_counter() - start
            bar.set_postfix_str(
                f"input {in_tokens / elapsed:.1f} tok/s, output {out_tokens / elapsed:.1f} tok/s", refresh=False
            )
            bar.update(1)

        try:
            outputs = engine.run_until_finished(ids, progress if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()
        failed = [c.stop_reason for out in outputs for c in out.outputs if c.finish_reason == "error"]
        if failed:  # a plugin failed on some requests; the others' outputs ride along
            raise EngineError(f"{len(failed)} of {len(outputs)} requests failed: {failed[0]}", outputs)
        return outputs


    # --- the pooling runner (model.runner="pooling") --------------------------------------
    def encode(self, prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
               use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Each prompt (text, or token ids) pooled into one vector (``outputs.data``), in input
        order; needs ``runner="pooling"``. A request a plugin failed on raises EngineError with
        every output in ``.outputs``."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast(pooling_params or PoolingParams(), len(prompt_list), "pooling_params")
        engine = self.engine
        ids = []
        try:
            for prompt, params in zip(prompt_list, params_list):
                ids.append(engine.add_request(None, prompt, params, output_kind=RequestOutputKind.FINAL_ONLY))
        except Exception:
            engine.abort_request(ids)
            raise
        bar = _progress(len(ids)) if use_tqdm else None
        try:
            outputs = engine.run_until_finished(ids, (lambda _: bar.update(1)) if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()
        failed = [o.error for o in outputs if o.outputs is None]
        if failed:
            raise EngineError(f"{len(failed)} of {len(outputs)} requests failed: {failed[0]}", outputs)
        return outputs

    def embed(self, prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
              use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Embeddings (``outputs.embedding``, a list of floats), as vLLM's ``LLM.embed``."""
        return self.encode(prompts, pooling_params, use_tqdm=use_tqdm)

    def classify(self, prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]], *,
                 use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Each prompt's label probabilities (``outputs.probs``, in the order of
        ``model_info.pooling["labels"]``), as vLLM's ``LLM.classify``: needs a classifier (a
        ``*ForSequenceClassification`` checkpoint, or ``pooling.classifier_from_tokens``)."""
        info = self.engine.model_info.pooling or {}
        if info and not info.get("labels"):
            raise InvalidRequestError(NOT_A_CLASSIFIER)
        return self.encode(prompts, use_tqdm=use_tqdm)

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], *,
              use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """One query against each document (or pairwise, for two lists of one length):
        ``outputs.score`` per pair, in order (``paged.core.frontend.scoring``)."""
        pairs = pair_up(text_1, text_2)
        info = self.engine.model_info.pooling or {}
        prompts = classifier_prompts(info, pairs)
        if prompts is not None:
            return self.encode(prompts, use_tqdm=use_tqdm)
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        embedded = dict(zip(texts, self.encode(texts, use_tqdm=use_tqdm)))
        scores = cosine_scores(pairs, {t: o.outputs.data for t, o in embedded.items()})
        return [PoolingRequestOutput(f"score-{i}", None, embedded[d].prompt_token_ids,
                                     PoolingOutput(np.array([s], dtype=np.float32), s))
                for i, ((_, d), s) in enumerate(zip(pairs, scores))]


def _tool_calls(mode: str, name: str | None, parser, c) -> list:
    if mode in ("named", "required"):
        if c.finish_reason == "length":
            return []  # cut off by max_tokens: the constrained JSON is incomplete
        return calls_from_constrained(mode, name, c.text)
    return parser.parse(c.text)[1]


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="prompt", dynamic_ncols=True)


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _broadcast(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ConfigError(f"{name}: got {len(value)} values for {n} prompts; give one, or one per prompt")
        return list(value)
    return [value] * n
