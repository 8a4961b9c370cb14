"""``paged config``: the effective configuration, and what it resolves to on this machine
(device, attention backend, model files, dtype) without loading, converting or downloading."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

from paged.core.config import EngineConfig, resolve_plugins


def resolved_view(config: EngineConfig) -> dict[str, Any]:
    """What will run: every ``auto`` and unset value replaced by what the engine will pick."""
    import torch

    from paged.core.loading.loader import get_dtype

    device = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    plugins = resolve_plugins(config, device=device)
    model, model_dir = describe_model(config.model.model, config.model.revision)
    if config.model.dtype != "auto" or device == "cpu":
        dtype = str(get_dtype(config.model.dtype, None, device)).replace("torch.", "")
    elif model_dir is not None:
        from paged.core.loading.loader import load_hf_config

        dtype = str(get_dtype("auto", load_hf_config(model_dir), device)).replace("torch.", "")
    else:
        dtype = "the checkpoint's float16/bfloat16, else bfloat16 (decided once the model is there)"
    return {
        "device": device,
        "model": model,
        "dtype": dtype,
        "attention_backend": plugins.attention.name,
        "attention_options": plugins.attention_options.model_dump(mode="json") if plugins.attention_options else {},
        "policy": plugins.policy.name,
        "policy_options": plugins.policy_options.model_dump(mode="json") if plugins.policy_options else {},
    }


def describe_model(model: str | None, revision: str | None) -> tuple[str, Path | None]:
    """(a description of where the weights come from, the model directory when it exists now)."""
    from paged.core.loading import gguf, hub

    if not model or str(model).lower().endswith(".gguf"):
        source = gguf.default_gguf_path() if not model else Path(model).expanduser().resolve()
        target, done = gguf.conversion_target(source)
        what = "the embedded SmolLM2-135M-Instruct: " if not model else ""
        return f"{what}{target} (converted from {source}{'' if done else ' on first run'})", target if done else None
    if hub.is_hub_id(model):
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(model, revision=revision, allow_patterns=hub.ALLOW_PATTERNS,
                                          local_files_only=True))
            return f"hub {model}@{revision or 'main'}: {path}", path
        except Exception:  # not cached (or no huggingface_hub): the run will say exactly why
            return f"hub {model}@{revision or 'main'} (not in the Hugging Face cache: downloaded on first run)", None
    path = Path(model).expanduser().resolve()
    return str(path), path if (path / "config.json").is_file() else None


def cmd_config(args: argparse.Namespace) -> int:
    from paged.core.cli.flags import engine_config_from_args

    config = engine_config_from_args(args)
    resolved = resolved_view(config)
    data = config.to_dict()
    if data["server"]["api_key"]:
        data["server"]["api_key"] = "***"  # set, but not printed
    # the options given, as their typed models read them (5.0, not "5"); the output stays a valid config file
    for section, key, typed in (("scheduler", "policy_options", "policy_options"), ("attention", "options", "attention_options")):
        data[section][key] = {k: resolved[typed][k] for k in data[section][key]}
    if args.json:
        print(json.dumps({**data, "resolved": resolved}, indent=2))
        return 0
    print(yaml.safe_dump(data, sort_keys=False), end="")
    print("# what will run here (from the settings above):")
    for line in yaml.safe_dump(resolved, sort_keys=False, width=1000).splitlines():
        print(f"#   {line}")
    return 0
