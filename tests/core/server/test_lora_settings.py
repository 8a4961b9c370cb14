"""The LoRA settings of ``paged serve``, checked before anything starts: runtime loading needs an
API key and an adapter folder, adapters need --enable-lora, and the load/unload routes exist only
when runtime loading is on; ``--lora-modules`` takes vLLM's NAME=PATH and JSON forms."""

from __future__ import annotations

import pytest

from paged.core.config import load_config
from paged.core.errors import ConfigError
from paged.core.server.app import build_app
from paged.core.server.lora import check_lora_serving, confined_path
from paged.core.server.errors import APIError


def config(tmp_path, **lora):
    server = {"api_key": lora.pop("api_key")} if "api_key" in lora else {}
    return load_config(None, {"lora": lora, "server": server})


def routes(app) -> set[str]:
    return {getattr(r, "path", "") for r in app.routes}


def test_runtime_loading_needs_a_key_a_folder_and_lora(tmp_path):
    for missing, settings in (
        ("server.api_key", dict(enable_lora=True, lora_adapter_dir=str(tmp_path))),
        ("lora.lora_adapter_dir", dict(enable_lora=True, api_key="k")),
        ("lora.enable_lora", dict(lora_adapter_dir=str(tmp_path), api_key="k")),
    ):
        with pytest.raises(ConfigError, match=f"lora.allow_runtime_lora_updating: needs {missing}"):
            check_lora_serving(config(tmp_path, allow_runtime_lora_updating=True, **settings), "m")
    with pytest.raises(ConfigError, match="lora.lora_adapter_dir: .* is not a folder"):
        check_lora_serving(config(tmp_path, allow_runtime_lora_updating=True, enable_lora=True, api_key="k",
                                  lora_adapter_dir=str(tmp_path / "nope")), "m")
    with pytest.raises(ConfigError, match="adapters are given but LoRA is off; add --enable-lora"):
        check_lora_serving(config(tmp_path, lora_modules=["a=/x"]), "m")
    with pytest.raises(ConfigError, match="the adapter name 'm' is the served model's name"):
        check_lora_serving(config(tmp_path, enable_lora=True, lora_modules=["m=/x"]), "m")


def test_the_load_routes_exist_only_when_runtime_loading_is_on(tmp_path):
    off = build_app(config(tmp_path, enable_lora=True))
    assert "/v1/load_lora_adapter" not in routes(off) and "/v1/unload_lora_adapter" not in routes(off)
    on = build_app(config(tmp_path, enable_lora=True, allow_runtime_lora_updating=True, api_key="k",
                          lora_adapter_dir=str(tmp_path)))
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= routes(on)


def test_paths_are_confined_to_the_adapter_folder(tmp_path):
    (tmp_path / "adapters" / "x").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "adapters" / "link").symlink_to(tmp_path / "outside")
    root = str(tmp_path / "adapters")
    assert confined_path(root, "x") == str(tmp_path / "adapters" / "x")
    assert confined_path(root, str(tmp_path / "adapters" / "x")) == str(tmp_path / "adapters" / "x")
    for path in ("../outside", str(tmp_path / "outside"), "link", "x/../../outside", "", None, 3):
        with pytest.raises(APIError) as e:
            confined_path(root, path)
        assert e.value.status == 400 and e.value.param == "lora_path"


def test_lora_modules_flag_forms():
    from paged.core.cli.flags import Parser, add_engine_flags, engine_config_from_args

    parser = Parser()
    add_engine_flags(parser)
    args = parser.parse_args(["--enable-lora", "--lora-modules", "a=/p/a", '{"name": "b", "path": "/p/b"}',
                              "--max-loras", "4"])
    lora = engine_config_from_args(args).lora
    assert lora.enable_lora and lora.max_loras == 4
    assert [(r.lora_name, r.lora_int_id, r.lora_path) for r in lora.module_requests()] == [("a", 1, "/p/a"), ("b", 2, "/p/b")]
    with pytest.raises(ConfigError, match="lora.lora_modules: .*'a' is not an adapter; give NAME=PATH"):
        load_config(None, {"lora": {"lora_modules": ["a"]}})
    with pytest.raises(ConfigError, match="the adapter name 'a' is given twice"):
        load_config(None, {"lora": {"lora_modules": ["a=/x", "a=/y"]}})


def test_the_kernel_setting_names_what_is_accepted(tmp_path):
    import torch

    from paged.core.engine.lora_manager import resolve_lora_kernel
    from paged.core.registry import get_registry

    registry = get_registry()
    with pytest.raises(ConfigError, match="lora.kernel: unknown value 'cpp'. Did you mean 'cpu'\\? Available: cpu, torch"):
        resolve_lora_kernel(config(tmp_path, enable_lora=True, kernel="cpp"), registry, torch.device("cpu"), torch.float32)
    with pytest.raises(ConfigError, match="lora.kernel: 'cpu' cannot run here: .* Kernels that work on this machine: torch"):
        resolve_lora_kernel(config(tmp_path, enable_lora=True, kernel="cpu"), registry, torch.device("cuda"),
                            torch.float32)
    spec, kernel = resolve_lora_kernel(config(tmp_path, enable_lora=True), registry, torch.device("cuda"), torch.float32)
    assert spec.name == "torch"  # auto: the C++ kernel is the CPU's
    with pytest.raises(ConfigError, match="lora.options.gemm_min_rows"):
        resolve_lora_kernel(config(tmp_path, enable_lora=True, options={"gemm_min_rows": 0}), registry,
                            torch.device("cpu"), torch.float32)
