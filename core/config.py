"""Typed engine configuration.

One ``EngineConfig`` with nested sections. Sources, highest first::

    CLI flags  >  PAGED_* environment (nested with "__")  >  --config FILE (TOML/YAML)  >  defaults

e.g. ``--policy=priority``, ``PAGED_SCHEDULER__POLICY=priority`` and ``[scheduler] policy =
"priority"`` set the same field. The file is merged as data, never turned back into flags.
Unknown keys are errors everywhere. Plugin names and plugin options are checked against the
loaded plugins by ``resolve_plugins``.
"""

from __future__ import annotations

import contextvars
import difflib
import json
import logging
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from paged.core.errors import ConfigError

if TYPE_CHECKING:  # annotations only: the specs' module imports torch, which reading a config does not need
    from paged.core.hookspecs import AttentionBackendSpec, PolicySpec

logger = logging.getLogger("paged")

class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _text_list(value: Any, split: Callable[[str], list[str]]) -> Any:
    """A list setting given as text (a flag, a ``PAGED_*`` variable): a JSON list, else
    ``split(text)``; a value that is not text is left to the field's own validation."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        try:
            return json.loads(text)
        except ValueError:
            return value
    return split(text)


class ModelConfig(_Section):
    model: str | None = Field(
        None, description="HF model directory, .gguf file or hub id (org/name); unset = the embedded "
        "SmolLM2-135M-Instruct",
    )
    revision: str | None = Field(None, description="hub revision (branch, tag or commit) of a hub model id")
    tokenizer: str | None = Field(None, description="tokenizer directory (default: the model's)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="weights and activations; auto = the checkpoint's dtype on GPU; on CPU bfloat16 where "
        "the CPU computes it natively (AMX or AVX512-BF16), else float32",
    )
    quantization: str = Field(
        "auto",
        description="weight-only quantization: none, int8, int4 or a plugin's method (paged plugins lists "
        "them); auto = keep a GGUF's Q4/Q8 blocks quantized on a bfloat16 CPU, else none",
    )
    quantization_options: dict[str, Any] = Field(
        default_factory=dict, description="the quantization method's typed options"
    )
    max_model_len: int | None = Field(None, gt=0, description="prompt + output limit (default: the model's)")
    cpu_prepack_weights: bool = Field(
        True, description="bfloat16 on a CPU: linear weights in oneDNN's packed layout (faster small-batch GEMMs)"
    )
    compile: bool = Field(
        False,
        description="steps of up to compile_max_tokens tokens through torch.compile (inductor), attention opaque; "
        "on an AVX-512 BF16 CPU the eager step with paged's C++ kernels is faster (0.93-0.97x compiled), "
        "and it costs 20-120 s of start-up (benchmarks/compiled_step.py)",
    )
    compile_max_tokens: int = Field(2, ge=1, description="with model.compile: steps of up to this many tokens run compiled")
    runner: Literal["generate", "pooling"] = Field(
        "generate", description="generate: completions and chat; pooling: embeddings, /score and /rerank (each prompt "
        "becomes one vector: the pooling section)",
    )


class CacheConfig(_Section):
    block_size: int = Field(16, description="tokens per KV block (a power of two, 1..256)")
    enable_prefix_caching: bool = Field(True, description="reuse the KV blocks of prompts' common prefixes")
    kv_cache_memory_gib: float | None = Field(
        None, gt=0, description="KV budget on a CPU, GiB (default 1.0); on a GPU see gpu_memory_utilization"
    )
    num_blocks: int | None = Field(None, gt=0, description="force the number of KV blocks (tests, experiments)")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="share of GPU memory paged may use (KV cache sizing)")

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v < 1 or v > 256 or v & (v - 1):
            raise ValueError(f"must be a power of two between 1 and 256, got {v}")
        return v


class SchedulerConfig(_Section):
    policy: str = Field("fcfs", description="scheduling policy plugin (paged plugins lists them)")
    policy_options: dict[str, Any] = Field(default_factory=dict, description="the policy's typed options")
    max_num_seqs: int = Field(128, gt=0, description="most requests running at once")
    max_num_batched_tokens: int = Field(2048, gt=0, description="token budget of one step")
    long_prefill_token_threshold: int = Field(0, ge=0, description="cap of one prefill chunk; 0 = no cap")
    enable_chunked_prefill: bool = Field(True, description="split long prompts over steps to fit the token budget")


class AttentionConfig(_Section):
    backend: str = Field("auto", description="attention backend plugin; auto = best available")
    options: dict[str, Any] = Field(default_factory=dict, description="the backend's typed options")


class StructuredOutputConfig(_Section):
    backend: str = Field("xgrammar", description="structured-output (grammar) backend plugin")
    options: dict[str, Any] = Field(default_factory=dict, description="the backend's typed options")
    compile_workers: int = Field(2, gt=0, description="threads that compile constraints, off the step")
    max_schema_depth: int = Field(
        64, gt=0, description="deepest nesting of objects and arrays in a request's JSON schema (checked before "
        "queueing)",
    )
    max_constraint_bytes: int = Field(
        64 << 10, gt=0, description="largest constraint in UTF-8 bytes: a JSON schema as JSON, a regex, a grammar, "
        "or all choices together (checked before queueing)",
    )
    constraint_check_timeout_s: float = Field(
        10.0, gt=0, description="longest the front-end's check may spend compiling a new constraint (in a worker "
        "process, killed past it); a constraint that takes longer is refused",
    )
    constraint_check_workers: int = Field(
        1, gt=0, description="worker processes that compile new constraints for the front-end's check"
    )


class ParallelConfig(_Section):
    """Tensor and data parallelism. Engine cores on several machines (vLLM's flags): the first
    node runs the API server and cores ``0 .. data_parallel_size_local - 1``; each other node runs
    ``paged serve --headless`` with its ``data_parallel_start_rank``; all of them name the first
    node's ``data_parallel_address`` and ``data_parallel_rpc_port`` (``paged.core.ipc``)."""

    tensor_parallel_size: int = Field(
        1, gt=0, description="ranks that split each layer (processes on this machine, or torchrun's WORLD_SIZE)"
    )
    data_parallel_size: int = Field(1, gt=0, description="engine cores behind one `paged serve` front-end, on every node")
    data_parallel_size_local: int | None = Field(
        None, ge=0, description="engine cores this node runs (default: all of data_parallel_size from "
        "data_parallel_start_rank on)",
    )
    data_parallel_start_rank: int = Field(0, ge=0, description="the first data-parallel rank this node runs (0 on the "
                                          "node with the API server)")
    data_parallel_address: str | None = Field(
        None, description="the API server node's address, which engine cores on other nodes connect to (tcp, bound to "
        "this address only); unset = every core on this machine (ipc)",
    )
    data_parallel_rpc_port: int = Field(29550, ge=1, le=65534, description="the API server node's port for engine "
                                        "cores (it binds this one and the next)")
    headless: bool = Field(False, description="run engine cores only, for the API server on data_parallel_address "
                           "(the nodes after the first)")
    data_parallel_keys: str | None = Field(
        None, description="folder of CurveZMQ keys (paged keys DIR; the same folder on every node): traffic between "
        "nodes is authenticated and encrypted; required for an address that is not loopback",
    )
    data_parallel_on_core_loss: Literal["fail", "continue"] = Field(
        "fail", description="when an engine core is lost (its process or node gone): fail = the engine is dead (as "
        "server.on_engine_death says); continue = fail its requests, serve on the others, and let it rejoin",
    )
    data_parallel_heartbeat_s: float = Field(1.0, gt=0, description="engine cores and the API server tell each other "
                                             "they are alive this often")
    data_parallel_timeout_s: float = Field(5.0, gt=0, description="a core (or the API server, for a core) not heard "
                                           "from for this long is lost")
    data_parallel_start_timeout_s: float = Field(
        600.0, gt=0, description="with cores on other nodes: how long the API server waits for all of them to "
        "connect (the error names the ranks missing)",
    )

    @property
    def local_cores(self) -> int:
        """The data-parallel cores this node runs."""
        if self.data_parallel_size_local is not None:
            return self.data_parallel_size_local
        return self.data_parallel_size - self.data_parallel_start_rank

    @property
    def local_ranks(self) -> range:
        return range(self.data_parallel_start_rank, self.data_parallel_start_rank + self.local_cores)

    @property
    def multi_node(self) -> bool:
        """Cores connect over tcp (data_parallel_address set), from this node or others."""
        return self.data_parallel_address is not None

    @model_validator(mode="after")
    def _nodes_fit(self) -> "ParallelConfig":
        size, start, local = self.data_parallel_size, self.data_parallel_start_rank, self.local_cores
        if start + local > size:
            raise ValueError(f"data_parallel_start_rank {start} + data_parallel_size_local {local} exceeds "
                             f"data_parallel_size {size}: the ranks of a node must be among 0 .. {size - 1}")
        if self.headless:
            if self.data_parallel_address is None:
                raise ValueError("headless: needs data_parallel_address (the API server node's address, which its "
                                 "engine cores connect to)")
            if local < 1:
                raise ValueError("headless: data_parallel_size_local must be at least 1 (the cores this node runs)")
        elif start != 0:
            raise ValueError(f"data_parallel_start_rank: {start} on the node with the API server, which runs ranks from "
                             "0; a node that runs later ranks is started with --headless")
        elif local < 1:
            raise ValueError("data_parallel_size_local: the API server node runs at least rank 0 (1 or more)")
        elif local < size and self.data_parallel_address is None:
            raise ValueError(f"data_parallel_size_local: {local} of {size} cores here needs data_parallel_address, "
                             "which the other nodes' cores connect to")
        if self.data_parallel_timeout_s <= self.data_parallel_heartbeat_s:
            raise ValueError(f"data_parallel_timeout_s: {self.data_parallel_timeout_s} must exceed "
                             f"data_parallel_heartbeat_s ({self.data_parallel_heartbeat_s})")
        return self


class SpeculativeConfig(_Section):
    """Speculative decoding (``--speculative-config JSON`` sets the whole section, vLLM's way:
    keys other than these fields are the method's options)."""

    method: str | None = Field(
        None, description="proposer plugin: ngram (prompt lookup) or a plugin's (paged plugins lists them); "
        "unset = no speculation",
    )
    num_speculative_tokens: int = Field(4, ge=1, le=64, description="most draft tokens verified per request and step")
    disable_by_batch_size: int | None = Field(
        8, ge=1, description="no speculation in a step where more requests than this decode (on the 2-core CPU "
        "speculation gained up to B = 8 and lost from B = 16: benchmarks/speculative.py); unset = at any batch size",
    )
    min_acceptance_rate: float = Field(
        0.3, ge=0, le=1, description="a request whose last 16 draft tokens were accepted less often than this is "
        "not asked for 32 steps (a verified draft costs ~0.2-0.3 of a step on the CPU); 0 = never paused",
    )
    options: dict[str, Any] = Field(default_factory=dict, description="the proposer's typed options")

    @model_validator(mode="before")
    @classmethod
    def _method_options_at_top_level(cls, data: Any) -> Any:
        """``{"method": "ngram", "prompt_lookup_max": 4}`` as vLLM takes it: unknown keys are
        the method's options (checked against its options model when the engine starts)."""
        if not isinstance(data, dict):
            return data
        own = set(cls.model_fields)
        extra = {k: v for k, v in data.items() if k not in own}
        if not extra:
            return data
        return {**{k: v for k, v in data.items() if k in own}, "options": {**data.get("options", {}), **extra}}


class PoolingConfig(_Section):
    """The pooling runner (``model.runner: pooling``, see ``paged.core.pooling``)."""

    pooler: str = Field(
        "auto", description="last, mean, cls, max or a plugin's (paged plugins lists them); auto = the checkpoint's "
        "sentence-transformers pooling (modules.json), else last",
    )
    normalize: bool | None = Field(
        None, description="L2-normalise embeddings (a request's normalize wins); unset = as the checkpoint's "
        "sentence-transformers modules say, else true",
    )
    classifier_from_tokens: list[str] | None = Field(
        None, description="score with the LM head: the logits of these tokens at the last position, e.g. "
        "no,yes for Qwen3-Reranker; a score is the last token's softmax probability over them",
    )
    score_template: str = Field(
        "{query}\n{document}", description="how /score and /rerank join a query and a document for a classifier "
        "({query} and {document} are replaced)",
    )
    max_dimensions: int | None = Field(
        None, ge=1, description="a request's dimensions (Matryoshka truncation) is accepted up to this; unset = the "
        "checkpoint's config.json matryoshka_dimensions / is_matryoshka, else not accepted",
    )
    options: dict[str, Any] = Field(default_factory=dict, description="the pooler's typed options")

    @field_validator("classifier_from_tokens", mode="before")
    @classmethod
    def _token_list(cls, value: Any) -> Any:
        """A flag's or variable's text: a JSON list, or words separated by commas."""
        return _text_list(value, lambda text: [w for w in text.split(",") if w])

    @field_validator("classifier_from_tokens")
    @classmethod
    def _not_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise ValueError("must name at least one token")
        return value

    @field_validator("score_template")
    @classmethod
    def _has_placeholders(cls, value: str) -> str:
        for name in ("{query}", "{document}"):
            if name not in value:
                raise ValueError(f"must contain {name}")
        return value


class LoRAConfig(_Section):
    """LoRA adapters served over the base model (``paged.core.lora``), as vLLM's flags name them."""

    enable_lora: bool = Field(False, description="serve LoRA adapters (PEFT checkpoints) over the base model")
    max_loras: int = Field(1, ge=1, description="most distinct adapters in one step (each linear layer holds this "
                           "many adapter slots)")
    max_lora_rank: int = Field(16, ge=1, le=512, description="largest adapter rank accepted (the slots' size)")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="adapters kept in memory, least recently used dropped (read again from their "
        "folder when asked for); unset = max(max_loras, 8)",
    )
    lora_modules: list[str] = Field(
        default_factory=list, description="adapters served from the start, each NAME=PATH (or a JSON object with "
        "name and path); clients choose one by its name as the request's model",
    )
    kernel: str = Field("auto", description="LoRA kernel plugin: cpu (C++), torch or a plugin's; auto = the best "
                        "available")
    options: dict[str, Any] = Field(default_factory=dict, description="the kernel's typed options")
    allow_runtime_lora_updating: bool = Field(
        False, description="/v1/load_lora_adapter and /v1/unload_lora_adapter (needs server.api_key and "
        "lora.lora_adapter_dir)",
    )
    lora_adapter_dir: str | None = Field(
        None, description="runtime-loaded adapters must lie inside this folder (no path outside it is read)"
    )

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _module_list(cls, value: Any) -> Any:
        """A flag's or variable's text: a JSON list, or NAME=PATH items separated by spaces."""
        return _text_list(value, str.split)

    @field_validator("lora_modules")
    @classmethod
    def _each_module(cls, value: list[str]) -> list[str]:
        names = [parse_lora_module(item)[0] for item in value]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"the adapter name {repeated[0]!r} is given twice; each name must be unique")
        return value

    def module_requests(self) -> list[Any]:
        """``lora_modules`` as ``LoRARequest``s, ids 1, 2, ... in order, paths made absolute (every
        engine core reads them at start-up; runtime-loaded adapters get the ids after these)."""
        from paged.core.lora import LoRARequest

        return [LoRARequest(name, i, str(Path(path).expanduser().absolute()))
                for i, (name, path) in enumerate(map(parse_lora_module, self.lora_modules), start=1)]

    @property
    def cpu_loras(self) -> int:
        """Adapters kept in memory (``max_cpu_loras``, at least ``max_loras``)."""
        return max(self.max_cpu_loras or max(self.max_loras, 8), self.max_loras)


def parse_lora_module(item: Any) -> tuple[str, str]:
    """One ``lora.lora_modules`` entry as (name, path): ``NAME=PATH``, or a JSON object (or dict)
    with ``name`` and ``path`` (vLLM's two forms). Raises ValueError saying what is accepted."""
    if isinstance(item, str) and item.lstrip().startswith("{"):
        try:
            item = json.loads(item)
        except ValueError as e:
            raise ValueError(f"{item!r} is not valid JSON ({e}); give NAME=PATH or {{\"name\": ..., \"path\": ...}}") from None
    if isinstance(item, dict):
        name, path = item.get("name"), item.get("path")
    elif isinstance(item, str):
        name, sep, path = item.partition("=")
        if not sep:
            name = path = None
    else:
        name = path = None
    if not isinstance(name, str) or not name.strip() or not isinstance(path, str) or not path.strip():
        raise ValueError(f"{item!r} is not an adapter; give NAME=PATH or {{\"name\": ..., \"path\": ...}}")
    return name.strip(), path.strip()


class ServerConfig(_Section):
    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0: every interface)")
    port: int = Field(8000, ge=0, le=65535, description="TCP port to listen on")
    api_key: str | None = Field(None, description="require 'Authorization: Bearer KEY' on every request")
    served_model_name: str | None = Field(None, description="the model name clients send (default: the model's)")
    metrics_api_key: str | None = Field(None, description="also accepted on /metrics and /debug/engine")
    public_metrics: bool = Field(False, description="/metrics answers without a key even when api_key is set")
    allowed_hosts: list[str] | None = Field(
        None, description="Host header names accepted (DNS rebinding); default: the bound address "
        "(plus localhost names on loopback, anything on 0.0.0.0 / ::); ['*'] = any"
    )
    max_body_bytes: int = Field(8 << 20, gt=0, description="largest request body")
    max_n: int = Field(128, gt=0, description="most samples (n) per prompt")
    max_samples_per_request: int = Field(256, gt=0, description="most n x prompts in one request")
    max_stop: int = Field(16, gt=0, description="most stop strings, and most stop_token_ids, per request")
    max_stored_responses: int = Field(
        1000, ge=0, description="/v1/responses kept in memory for previous_response_id and GET (newest first)"
    )
    reasoning_parser: Literal["auto", "qwen3", "none"] = Field(
        "auto", description="chat responses: a <think> block as reasoning_content ('auto': for Qwen3 models)"
    )
    chat_default_max_tokens: int | None = Field(
        None, gt=0, description="chat max_tokens when a request sets none (default: up to max_model_len)"
    )
    shutdown_grace_s: float = Field(
        10.0, ge=0, description="on SIGTERM, time in-flight requests get to finish before they are ended"
    )
    on_engine_death: Literal["exit", "restart"] = Field(
        "exit", description="when an engine core dies: exit non-zero (for a supervisor), or restart the engine"
    )
    max_restarts: int = Field(
        5, gt=0, description="with on_engine_death=restart: restarts in a row before the server exits non-zero"
    )
    restart_backoff_s: float = Field(
        1.0, gt=0, description="with on_engine_death=restart: wait before the first restart; doubled for each next one"
    )
    restart_backoff_max_s: float = Field(
        30.0, gt=0, description="longest wait between restarts; an engine up this long resets the count of restarts"
    )

    @field_validator("restart_backoff_max_s")
    @classmethod
    def _at_least_the_first_backoff(cls, v: float, info) -> float:
        first = info.data.get("restart_backoff_s")
        if first is not None and v < first:
            raise ValueError(f"must be at least restart_backoff_s ({first})")
        return v


_config_file: contextvars.ContextVar[Path | None] = contextvars.ContextVar("paged_config_file", default=None)


def read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config: no such file {str(path)!r}")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        else:
            raise ConfigError(f"--config: {str(path)!r} must end in .toml, .yaml or .yml")
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"--config: cannot parse {str(path)!r}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {str(path)!r} must hold a table of settings, got {type(data).__name__}")
    return data


class _FileSource(PydanticBaseSettingsSource):
    """The --config file as a settings source (below the environment)."""

    def get_field_value(self, field, field_name):  # unused: __call__ returns the whole mapping
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = _config_file.get()
        return read_config_file(path) if path is not None else {}


class EngineConfig(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="PAGED_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
        nested_model_default_partial_update=True,
    )

    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = a CUDA GPU when there is one, else the CPU")
    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    attention: AttentionConfig = Field(default_factory=AttentionConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    structured_output: StructuredOutputConfig = Field(default_factory=StructuredOutputConfig)
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    pooling: PoolingConfig = Field(default_factory=PoolingConfig)
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):
        return (init_settings, env_settings, _FileSource(settings_cls))

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


# PAGED_* variables read elsewhere than the config (anything else PAGED_* should be a setting)
OTHER_ENV_VARS = ("PAGED_PLUGINS", "PAGED_DISABLE_PLUGINS", "PAGED_CACHE_DIR", "PAGED_REQUIRE_MODEL",
                  "PAGED_STARTUP_TIMES", "PAGED_QUANTIZED_CACHE", "PAGED_CPU_LAYER_OPS", "PAGED_CONFIG_SNAPSHOT",
                  "PAGED_DIRECT_LAYERS", "PAGED_DIRECT_PLAN")


def config_keys() -> list[str]:
    """Every settable key, dotted: ``device``, ``scheduler.policy``, ... (sections too)."""
    keys = []
    for name, info in EngineConfig.model_fields.items():
        keys.append(name)
        section = info.annotation
        if isinstance(section, type) and issubclass(section, BaseModel):
            keys += [f"{name}.{field}" for field in section.model_fields]
    return keys


def _closest_key(key: str) -> str | None:
    candidates = config_keys()
    exact_leaf = [c for c in candidates if "." in c and c.rpartition(".")[2] == key]
    if exact_leaf:  # a field named without its section: "policy" -> "scheduler.policy"
        return exact_leaf[0]
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if close:
        return close[0]
    # a field named without its section, or misspelled: "policy" / "polcy" -> "scheduler.policy"
    by_leaf = {c.rpartition(".")[2]: c for c in reversed(candidates)}
    close = difflib.get_close_matches(key.rpartition(".")[2], list(by_leaf), n=1, cutoff=0.75)
    return by_leaf[close[0]] if close else None


def _env_name(key: str) -> str:
    return "PAGED_" + key.replace(".", "__").upper()


def format_validation_error(error: ValidationError, prefix: str = "") -> str:
    lines = []
    for item in error.errors():
        loc = ".".join(str(p) for p in item["loc"])
        loc = f"{prefix}{loc}" if loc else prefix.rstrip(".") or "config"
        value = item.get("input")
        shown = "" if item["type"] == "missing" or isinstance(value, dict) else f" (got {value!r})"
        msg = item["msg"]
        if item["type"] == "extra_forbidden":
            msg = "unknown setting"
            if not prefix:  # an EngineConfig key (plugin options are checked by their own models)
                close = _closest_key(loc)
                if _env_name(loc) in os.environ:  # most likely where it came from
                    msg += f" (environment variable {_env_name(loc)})"
                    close = close and _env_name(close)
                msg += f"; did you mean {close}?" if close else ""
        lines.append(f"{loc}: {msg}{shown}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def check_environment(environ: dict[str, str] | None = None) -> list[str]:
    """Warn about ``PAGED_*`` variables that set nothing (a typo would otherwise be silently
    ignored: pydantic-settings only reads the names it knows); returns the warnings."""
    environ = os.environ if environ is None else environ
    known = {_env_name(k) for k in config_keys()} | set(OTHER_ENV_VARS)
    options = ("PAGED_SCHEDULER__POLICY_OPTIONS__", "PAGED_ATTENTION__OPTIONS__", "PAGED_LORA__OPTIONS__")
    warnings = []
    for name in sorted(environ):
        if not name.startswith("PAGED_") or name in known or name.startswith(options):
            continue
        if name.startswith(tuple(f"{_env_name(s)}__" for s in EngineConfig.model_fields)):
            continue  # PAGED_SECTION__FIELD: an unknown field is a validation error with its own hint
        close = difflib.get_close_matches(name, OTHER_ENV_VARS, n=1, cutoff=0.8)
        key = None if close else _closest_key(name[len("PAGED_"):].lower().replace("__", "."))
        hint = f"; did you mean {close[0] if close else _env_name(key)}?" if close or key else ""
        warnings.append(f"environment variable {name} is not a paged setting and is ignored{hint}")
        if name not in _warned_env:
            _warned_env.add(name)
            logger.warning("%s", warnings[-1])
    return warnings


_warned_env: set[str] = set()  # each unknown variable is warned about once per process


def for_child_process(config: "EngineConfig") -> tuple[bytes, dict[str, str]]:
    """What a process started with this config (an engine core, a tensor-parallel rank) gets:
    the config as JSON for its stdin (without the API key, which it has no use for) and the
    environment without ``PAGED_*`` (the JSON is the whole config; the variables would override it)."""
    data = config.model_dump(mode="json")
    data["server"]["api_key"] = None
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGED_")}
    return json.dumps(data).encode(), env


def load_config(config_file: str | Path | None = None, overrides: dict[str, Any] | None = None) -> EngineConfig:
    """Build the effective config. ``overrides`` (nested dict, from CLI flags or ``LLM(**kw)``)
    win over the environment, which wins over the file."""
    token = _config_file.set(Path(config_file) if config_file is not None else None)
    check_environment()
    try:
        return EngineConfig(**(overrides or {}))
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None
    finally:
        _config_file.reset(token)


# --- flat CLI flags <-> nested fields -------------------------------------------------------
# Every field of every section gets a flag; a few get the short names users type.
FLAG_ALIASES = {
    ("scheduler", "policy"): "policy",
    ("attention", "backend"): "attention",
    ("model", "model"): "model",
    ("cache", "num_blocks"): "num-kv-blocks",
    ("structured_output", "backend"): "structured-output-backend",
    ("structured_output", "compile_workers"): "structured-output-compile-workers",
    ("speculative", "method"): "speculative-method",
    ("speculative", "disable_by_batch_size"): "speculative-disable-by-batch-size",
    ("speculative", "min_acceptance_rate"): "speculative-min-acceptance-rate",
    ("pooling", "normalize"): "pooling-normalize",
    ("pooling", "max_dimensions"): "pooling-max-dimensions",
    ("lora", "kernel"): "lora-kernel",
    ("parallel", "headless"): "headless",
}


@dataclass(frozen=True)
class Flag:
    name: str  # without the leading dashes
    section: str | None
    field: str
    annotation: Any
    help: str


def config_flags() -> list[Flag]:
    flags: list[Flag] = []
    for name, info in EngineConfig.model_fields.items():
        section_cls = info.annotation
        if isinstance(section_cls, type) and issubclass(section_cls, BaseModel):
            for fname, finfo in section_cls.model_fields.items():
                if fname in ("policy_options", "options", "quantization_options"):
                    continue  # set with --policy-option / --attention-option KEY=VALUE
                flag = FLAG_ALIASES.get((name, fname), fname.replace("_", "-"))
                flags.append(Flag(flag, name, fname, finfo.annotation, finfo.description or ""))
        else:
            flags.append(Flag(name.replace("_", "-"), None, name, info.annotation, info.description or ""))
    return flags


def parse_key_values(items: list[str] | None, flag: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--{flag}: expected KEY=VALUE, got {item!r}")
        out[key.strip()] = value
    return out


# --- plugin names and options ---------------------------------------------------------------
@dataclass(frozen=True)
class ResolvedPlugins:
    """The selected policy and attention backend, with their validated options."""

    policy: PolicySpec
    policy_options: BaseModel | None
    attention: AttentionBackendSpec
    attention_options: BaseModel | None


def validate_options(spec: PolicySpec | AttentionBackendSpec, options: dict[str, Any], field_name: str) -> BaseModel | None:
    if spec.options is None:
        if options:
            raise ConfigError(f"{field_name}: {spec.name!r} takes no options, got {sorted(options)}")
        return None
    try:
        return spec.options.model_validate(options)
    except ValidationError as e:
        accepted = ", ".join(f"{name} (default {f.default!r})" if not f.is_required() else f"{name} (required)"
                             for name, f in spec.options.model_fields.items())
        raise ConfigError(format_validation_error(e, prefix=f"{field_name}.")
                          + f"\n  {spec.name!r} accepts: {accepted or '(no options)'}") from None


def check_quantization(config: "EngineConfig", registry=None) -> None:
    """``model.quantization`` names a registered method (or none/auto) and its options validate:
    checked before anything loads (the quantizer itself is made after the weights are read)."""
    from paged.core.quantization import AUTO, NONE
    from paged.core.registry import get_registry

    name = config.model.quantization
    if name in (NONE, AUTO):
        return
    registry = registry or get_registry()
    validate_options(registry.quantization_method(name), config.model.quantization_options,
                      "model.quantization_options")


def resolve_plugins(config: EngineConfig, registry=None, device: str = "cpu") -> ResolvedPlugins:
    """Check ``--policy`` and ``--attention`` against the loaded plugins and validate their
    options. ``attention=auto`` picks the available backend with the highest auto_priority."""
    from paged.core.registry import get_registry

    registry = registry or get_registry()
    policy = registry.policy(config.scheduler.policy)
    policy_options = validate_options(policy, config.scheduler.policy_options, "scheduler.policy_options")
    attention = choose_available(registry.attention_backends, config.attention.backend, registry.attention_backend,
                                 "attention.backend", "backend", device)
    attention_options = validate_options(attention, config.attention.options, "attention.options")
    return ResolvedPlugins(policy, policy_options, attention, attention_options)


def choose_available(specs: dict[str, Any], name: str, lookup: Callable[[str], Any], field: str, noun: str,
                     device: str) -> Any:
    """The spec ``name`` names (``lookup``: the registry's, which explains an unknown name), or
    with ``auto`` the one of ``specs`` available on ``device`` with the highest ``auto_priority``;
    ConfigError naming ``field`` when it cannot run here."""
    if name == "auto":
        ranked = sorted(specs.values(), key=lambda s: -s.auto_priority)
        usable = [s for s in ranked if s.is_available(device)[0]]
        if not usable:
            raise ConfigError(f"{field}: no {noun} is available on {device!r}")
        return usable[0]
    spec = lookup(name)
    ok, reason = spec.is_available(device)
    if not ok:
        working = [s.name for s in specs.values() if s.is_available(device)[0]]
        raise ConfigError(f"{field}: {spec.name!r} cannot run here: {reason}. "
                          f"{noun.capitalize()}s that work on this machine: {', '.join(working) or '(none)'}.")
    return spec


def resolve_structured_output(config: EngineConfig, registry=None) -> tuple[Any, BaseModel | None]:
    """The structured-output backend spec named by the config, and its validated options."""
    from paged.core.registry import get_registry

    registry = registry or get_registry()
    spec = registry.structured_output_backend(config.structured_output.backend)
    ok, reason = spec.is_available()
    if not ok:
        raise ConfigError(f"structured_output.backend: {spec.name!r} cannot run here: {reason}")
    return spec, validate_options(spec, config.structured_output.options, "structured_output.options")


def dump_config(config: EngineConfig, fmt: str = "yaml") -> str:
    data = config.to_dict()
    if fmt == "json":
        return json.dumps(data, indent=2)
    return yaml.safe_dump(data, sort_keys=False)
