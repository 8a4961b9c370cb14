"""LoRA adapters on the server (vLLM's interface): ``--enable-lora --lora-modules NAME=PATH ...``
serves each adapter under its name (a request's ``model`` picks it; ``/v1/models`` lists it with
``parent``, the base model). With ``lora.allow_runtime_lora_updating``, ``POST
/v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter``
``{"lora_name"}`` add and remove adapters while the server runs.

Runtime updates read files the client names, so they are off by default and, when on, need
``server.api_key`` (every request carries the key) and ``lora.lora_adapter_dir``: a ``lora_path``
is taken relative to that folder and, with every symbolic link resolved, must lie inside it (no
``..``, absolute path or link leads out). An adapter is read and checked by every engine core when
it is loaded (a 400 names the file and the field); an unloaded adapter's requests in flight finish
with it, and the cores drop it from memory when the last one ends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi.responses import JSONResponse

from paged.core.config import EngineConfig
from paged.core.errors import ConfigError, InvalidRequestError
from paged.core.lora import LoRARequest
from paged.core.server.errors import APIError, invalid
from paged.core.server.state import ServerState


def check_lora_serving(config: EngineConfig, served_model_name: str) -> None:
    """The LoRA settings of a server, checked before it starts (ConfigError naming the setting)."""
    lora = config.lora
    names = [r.lora_name for r in lora.module_requests()]
    if names and not lora.enable_lora:
        raise ConfigError("lora.lora_modules: adapters are given but LoRA is off; add --enable-lora")
    if served_model_name in names:
        raise ConfigError(f"lora.lora_modules: the adapter name {served_model_name!r} is the served model's name; "
                          "give the adapter another name")
    if not lora.allow_runtime_lora_updating:
        return
    missing = [name for name, value in (("lora.enable_lora", lora.enable_lora), ("server.api_key", config.server.api_key),
                                        ("lora.lora_adapter_dir", lora.lora_adapter_dir)) if not value]
    if missing:
        raise ConfigError(f"lora.allow_runtime_lora_updating: needs {', '.join(missing)} (runtime loading reads "
                          "files the client names: only with an API key, and only inside lora.lora_adapter_dir)")
    if not Path(lora.lora_adapter_dir).expanduser().is_dir():
        raise ConfigError(f"lora.lora_adapter_dir: {lora.lora_adapter_dir!r} is not a folder")


def confined_path(adapter_dir: str, lora_path: Any) -> str:
    """``lora_path`` within ``adapter_dir`` (relative to it), links resolved; raises a 400 if it
    leads outside."""
    if not isinstance(lora_path, str) or not lora_path.strip():
        raise invalid("lora_path: must be a non-empty string (a folder inside lora.lora_adapter_dir)", "lora_path")
    root = Path(adapter_dir).expanduser().resolve()
    path = (root / lora_path).resolve()
    if not path.is_relative_to(root):
        raise invalid(f"lora_path: {lora_path!r} lies outside the adapter folder (lora.lora_adapter_dir); give a "
                      "folder inside it, e.g. its name", "lora_path")
    return str(path)


def model_cards(state: ServerState, max_model_len: int) -> list[dict[str, Any]]:
    """``/v1/models``: the served model, then each adapter with its ``parent``."""
    base = state.served_model_name
    cards = [{"id": base, "object": "model", "created": state.created, "owned_by": "paged", "root": base,
              "parent": None, "max_model_len": max_model_len}]
    for name, request in state.loras.items():
        cards.append({"id": name, "object": "model", "created": state.created, "owned_by": "paged",
                      "root": request.lora_path, "parent": base, "max_model_len": max_model_len})
    return cards


def _name(body: Any) -> str:
    name = body.get("lora_name") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name.strip():
        raise invalid("lora_name: must be a non-empty string", "lora_name")
    return name


async def load_adapter(state: ServerState, body: Any) -> JSONResponse:
    llm = state.require_llm()
    name = _name(body)
    path = confined_path(state.config.lora.lora_adapter_dir, body.get("lora_path"))
    async with state.lora_lock:
        if name in state.loras or name == state.served_model_name:
            raise invalid(f"lora_name: {name!r} is already served; unload it first, or choose another name",
                          "lora_name")
        request = LoRARequest(name, state.next_lora_id, path)
        try:
            await llm.add_lora(request)
        except InvalidRequestError as e:
            raise invalid(str(e), "lora_path") from None
        state.next_lora_id += 1  # ids are never reused: the prefix cache keys on them
        state.loras[name] = request
    return JSONResponse({"message": f"Success: LoRA adapter '{name}' added successfully."})


async def unload_adapter(state: ServerState, body: Any) -> JSONResponse:
    llm = state.require_llm()
    name = _name(body)
    async with state.lora_lock:
        request = state.loras.get(name)
        if request is None:
            raise APIError(404, f"lora_name: no adapter {name!r} is served", "invalid_request_error", "lora_name",
                           "model_not_found")
        del state.loras[name]  # new requests cannot name it; those in flight finish with it
        await llm.remove_lora(request.lora_int_id)
    return JSONResponse({"message": f"Success: LoRA adapter '{name}' removed successfully."})
