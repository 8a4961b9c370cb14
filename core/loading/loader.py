"""From a ``model`` setting to a loaded model: resolve the directory, read the HF config and
tokenizer, iterate the safetensors weights (memory-mapped; never pickle), pick the dtype, build.

The model is a directory with ``config.json`` + ``*.safetensors``, a ``.gguf`` file (converted once
into such a directory, see ``paged.core.loading.gguf``), a hub id ``org/name`` (a snapshot in the
Hugging Face cache, see ``paged.core.loading.hub``), or nothing, meaning the embedded
SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from paged.core.errors import ConfigError, ModelLoadError
from paged.core.loading.startup_times import phase
from paged.core.loading.tokenizer import load_tokenizer  # noqa: F401 (its old home)

logger = logging.getLogger("paged")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_INDEX_FILE = "model.safetensors.index.json"


# ---- where the model is --------------------------------------------------------------------


def resolve_model_dir(model: str | Path | None, revision: str | None = None) -> Path:
    """``None`` -> the embedded default (converted from its GGUF on first use); a ``.gguf`` file
    -> its converted directory (cached); a hub id ``org/name`` -> its snapshot at ``revision``;
    a directory with ``config.json`` -> itself."""
    from paged.core.loading import gguf, hub

    if model is None or str(model) == "":
        return gguf.default_model_dir()
    if hub.is_hub_id(str(model)):
        return resolve_model_dir(hub.hub_model_dir(str(model), revision))
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model: {str(model)!r} does not exist. Give a local HF model directory (config.json + "
            "*.safetensors), a .gguf file or a hub id (org/name), or leave model unset for the embedded "
            "SmolLM2-135M-Instruct."
        )
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return gguf.converted_model_dir(path)
        raise ModelLoadError(
            f"model: {str(model)!r} is a file but not a .gguf file; give a model directory or a .gguf file"
        )
    if not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f" It holds GGUF files: pass one of them as the model: {', '.join(ggufs)}." if ggufs else ""
        raise ModelLoadError(
            f"model: directory {str(path)!r} has no config.json, so it is not an HF model directory.{hint}"
        )
    return path


# ---- config, tokenizer -----------------------------------------------------------------------


def load_hf_config(model_dir: str | Path) -> Any:
    """The transformers config of a local model directory (``AutoConfig``, local files only).

    A ``model_type`` transformers does not know (a plugin's own architecture) still loads: the
    JSON becomes a plain ``PretrainedConfig`` whose attributes are its keys. After the first load
    of a given config.json this is a ``config_snapshot.ConfigSnapshot``, which answers the same
    attribute reads without importing transformers' model code (``config_snapshot.real`` gives
    the config itself)."""
    from paged.core.loading import config_snapshot
    from paged.core.loading.gguf import cache_dir

    with phase("hf config"):
        return config_snapshot.load(Path(model_dir), _load_hf_config, cache_dir())


def _load_hf_config(model_dir: Path) -> Any:
    from transformers import AutoConfig, PretrainedConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # unknown model_type, malformed json, ...
        raw: dict = {}
        try:
            raw = json.loads((model_dir / "config.json").read_text())
        except Exception:
            pass
        if isinstance(raw, dict) and raw.get("architectures"):
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING

            if raw.get("model_type") not in CONFIG_MAPPING:
                logger.info("config.json: model_type %r is unknown to transformers; read as a plain config",
                            raw.get("model_type"))
                return PretrainedConfig.from_dict(raw)
        raise ModelLoadError(
            f"model: cannot read {str(model_dir / 'config.json')!r} (model_type={raw.get('model_type')!r}, "
            f"architectures={raw.get('architectures')!r}): {type(e).__name__}: {e}"
        ) from e


def model_architecture(hf_config: Any) -> str:
    """The architecture name a ModelSpec is registered under (``config.architectures[0]``)."""
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise ModelLoadError(
            f"model: config.json has no 'architectures' entry (model_type={getattr(hf_config, 'model_type', None)!r}); "
            "cannot tell which model implementation to use"
        )
    return str(archs[0])


# ---- weights ---------------------------------------------------------------------------------


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's files: those named by ``model.safetensors.index.json`` when present,
    else ``model.safetensors``, else every ``*.safetensors`` of the directory."""
    model_dir = Path(model_dir)
    index = model_dir / _INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except Exception as e:
            raise ModelLoadError(f"model: cannot read {str(index)!r}: {type(e).__name__}: {e}") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [str(f.name) for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"model: {str(index)!r} names shards that do not exist: {', '.join(absent)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        hint = f" (found {', '.join(others)}: paged never loads pickle checkpoints)" if others else ""
        raise ModelLoadError(f"model: no .safetensors weights in {str(model_dir)!r}{hint}")
    return files


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of the checkpoint, memory-mapped on the CPU."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


# ---- dtype, build ----------------------------------------------------------------------------


def checkpoint_dtype(hf_config: Any) -> torch.dtype | None:
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(value, str):
        value = _DTYPES.get(value.replace("torch.", ""))
    return value if isinstance(value, torch.dtype) else None


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has AMX tiles or AVX512-BF16 (torch's own feature probes)."""
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def get_dtype(setting: str, hf_config: Any, device: torch.device | str) -> torch.dtype:
    """The weights/activations dtype for ``model.dtype``.

    ``auto``: on the CPU bfloat16 where it computes bfloat16 natively (AMX or AVX512-BF16:
    oneDNN's bfloat16 GEMMs are several times faster than float32 there), else float32. On a GPU the checkpoint's dtype when it is float16 or bfloat16;
    a float32 (or unspecified) checkpoint runs in bfloat16 (float16 where the GPU lacks bf16),
    since fp32 serving wastes the GPU and some kernels do not take it; ask for ``float32``
    explicitly to get it.
    """
    if setting in _DTYPES:
        return _DTYPES[setting]
    if setting != "auto":
        raise ConfigError(f"model.dtype: unknown value {setting!r}; accepted: auto, {', '.join(_DTYPES)}")
    device = torch.device(device)
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    ckpt = checkpoint_dtype(hf_config)
    if ckpt in (torch.float16, torch.bfloat16):
        return ckpt
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def build_model(
    model_dir: str | Path,
    hf_config: Any,
    model_spec_factory: Callable[..., Any],
    backend: Any,
    dtype: torch.dtype,
    device: torch.device | str,
    skip_weights: Callable[[str], bool] | None = None,
) -> Any:
    """Construct the model directly on ``dtype``/``device``, load its weights, eval mode. The
    checkpoint tensors ``skip_weights`` names are not the model's (a classifier's score head)."""
    start = time.perf_counter()
    with phase("load"):
        model = model_spec_factory(hf_config, backend, dtype, torch.device(device))
        weights = iter_safetensors(model_dir)
        if skip_weights is not None:
            weights = ((name, t) for name, t in weights if not skip_weights(name))
        model.load_weights(weights)
        model.eval()
    logger.info(
        "loaded %s from %s (%s, %s) in %.2f s",
        type(model).__name__, model_dir, str(dtype).replace("torch.", ""), device, time.perf_counter() - start,
    )
    return model
