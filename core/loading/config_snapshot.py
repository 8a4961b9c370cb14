"""A model's transformers config, without importing transformers' model code on every start.

Reading ``config.json`` through ``AutoConfig`` imports the architecture's configuration module,
and in transformers 5 that pulls in the registry of all model code and ``torch.distributed.tensor``:
1.5-2.5 s of a start that should take 3. So the first load of a given ``config.json`` (under a
given transformers version) does it once and writes a snapshot beside the other caches: the value
of every attribute of the resulting config that is plain JSON or a torch dtype, and the names of
all the attributes the config has. Later starts read the snapshot into a ``ConfigSnapshot`` that
answers those attributes at once; anything else (a method such as ``to_dict``, a nested config,
a property whose value is not plain data) builds the real config then, through the same loader.

Invariant: for every name, ``getattr(snapshot, name)`` equals ``getattr(real_config, name)``, or
raises ``AttributeError`` exactly when the real config would. Setting an attribute builds the real
config and sets it there. ``real(config)`` hands the real object to code that wants it; the engine
gives third-party model plugins the real config, so only the bundled models see a snapshot.

``AutoTokenizer`` reads the config too (its choice of tokenizer class depends on the model type),
so the class it chose for a directory is remembered the same way (``load_tokenizer``): later starts
call that class's ``from_pretrained`` directly, with the arguments ``AutoTokenizer`` passes it.

``PAGED_CONFIG_SNAPSHOT=0`` turns snapshots off (every start goes through ``AutoConfig`` and
``AutoTokenizer``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger("paged")

ENV = "PAGED_CONFIG_SNAPSHOT"
SNAPSHOT_VERSION = 1  # bump when what a snapshot holds changes: old snapshots are ignored


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


class ConfigSnapshot:
    """Attribute reads of a transformers config from a snapshot; the real config on demand."""

    __slots__ = ("_class_name", "_values", "_dtypes", "_names", "_build", "_real")

    def __init__(self, class_name: str, values: dict[str, Any], dtypes: dict[str, str], names: set[str],
                 build: Callable[[], Any]) -> None:
        object.__setattr__(self, "_class_name", class_name)
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_dtypes", dtypes)
        object.__setattr__(self, "_names", names)
        object.__setattr__(self, "_build", build)
        object.__setattr__(self, "_real", None)

    def __getattr__(self, name: str) -> Any:  # only for names not found on the snapshot itself
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        dtypes = object.__getattribute__(self, "_dtypes")
        if name in dtypes:
            import torch

            return getattr(torch, dtypes[name])
        if name not in object.__getattribute__(self, "_names"):
            raise AttributeError(f"{object.__getattribute__(self, '_class_name')!r} object has no attribute {name!r}")
        return getattr(_real_of(self), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(_real_of(self), name, value)
        object.__getattribute__(self, "_values").pop(name, None)
        object.__getattribute__(self, "_dtypes").pop(name, None)
        object.__getattribute__(self, "_names").add(name)

    def __repr__(self) -> str:
        return f"ConfigSnapshot({object.__getattribute__(self, '_class_name')})"


def _real_of(snapshot: ConfigSnapshot) -> Any:
    real = object.__getattribute__(snapshot, "_real")
    if real is None:
        name = object.__getattribute__(snapshot, "_class_name")
        logger.debug("config snapshot: building the real %s (an attribute the snapshot does not hold)", name)
        real = object.__getattribute__(snapshot, "_build")()
        object.__setattr__(snapshot, "_real", real)
    return real


def real(config: Any) -> Any:
    """The transformers config itself: built from a snapshot if need be, else ``config`` as it is."""
    return _real_of(config) if isinstance(config, ConfigSnapshot) else config


# ---- writing and reading snapshots ---------------------------------------------------------------


def _plain(value: Any) -> bool:
    """Whether ``value`` survives a JSON round trip unchanged (so a tuple, a float32 or a nested
    config does not: those are read from the real config)."""
    try:
        return json.loads(json.dumps(value, allow_nan=False)) == value and type(value) in (
            bool, int, float, str, list, dict, type(None)
        )
    except (TypeError, ValueError):
        return False


def take(config: Any) -> dict[str, Any]:
    """What a snapshot of ``config`` holds (JSON)."""
    import torch

    cls = type(config)
    names = set(dir(config)) | set(getattr(cls, "attribute_map", None) or {})  # aliases are not in dir()
    values: dict[str, Any] = {}
    dtypes: dict[str, str] = {}
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # reading deprecated aliases warns; a snapshot is not a user's read
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in sorted(names | set(vars(config))):
                if name.startswith("__"):
                    continue
                try:
                    value = getattr(config, name)
                except Exception:  # read from the real config, which raises the same way
                    continue
                if isinstance(value, torch.dtype):
                    dtypes[name] = str(value).removeprefix("torch.")
                elif not callable(value) and _plain(value):
                    values[name] = value
    finally:
        quiet.setLevel(level)
    return {
        "version": SNAPSHOT_VERSION,
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "values": values,
        "dtypes": dtypes,
        "names": sorted(names | set(values) | set(dtypes)),
    }


def snapshot_path(config_json: Path, cache_root: Path) -> Path:
    """Where the snapshot of this ``config.json`` lives: keyed by its bytes, the transformers
    version and ``SNAPSHOT_VERSION`` (a new transformers may resolve the same file differently)."""
    try:
        transformers_version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers_version = "none"
    digest = hashlib.sha256(config_json.read_bytes())
    digest.update(f"|transformers {transformers_version}|snapshot {SNAPSHOT_VERSION}".encode())
    return cache_root / "config-snapshots" / f"{digest.hexdigest()[:32]}.json"


def load(model_dir: Path, build: Callable[[Path], Any], cache_root: Path) -> Any:
    """The config of ``model_dir``: a ``ConfigSnapshot`` when one was written for this exact
    ``config.json``, else ``build(model_dir)`` (the real config), snapshotted for next time."""
    config_json = model_dir / "config.json"
    if not enabled() or not config_json.is_file():
        return build(model_dir)
    path = snapshot_path(config_json, cache_root)
    try:
        data = json.loads(path.read_text())
        if data.get("version") == SNAPSHOT_VERSION:
            return ConfigSnapshot(data["class"].rpartition(".")[2], data["values"], data["dtypes"],
                                  set(data["names"]), lambda: build(model_dir))
    except (OSError, ValueError, KeyError, AttributeError):  # none yet, or unreadable: build it again
        pass
    config = build(model_dir)
    try:
        _write_atomically(path, json.dumps(take(config)))
    except OSError as e:  # a read-only cache costs the next start time, nothing else
        logger.debug("config snapshot: not written to %s: %s", path, e)
    return config


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---- the tokenizer's class -------------------------------------------------------------------------

_TOKENIZER_INPUTS = ("config.json", "tokenizer_config.json", "tokenizer.json")  # what AutoTokenizer's choice reads


def tokenizer_snapshot_path(tokenizer_dir: Path, cache_root: Path) -> Path:
    try:
        transformers_version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers_version = "none"
    digest = hashlib.sha256(f"{tokenizer_dir.resolve()}|transformers {transformers_version}".encode())
    for name in _TOKENIZER_INPUTS:
        path = tokenizer_dir / name
        if path.is_file():
            st = path.stat()
            digest.update(f"|{name} {st.st_size} {st.st_mtime_ns}".encode())
    return cache_root / "config-snapshots" / f"tokenizer-{digest.hexdigest()[:32]}.json"


def load_tokenizer(tokenizer_dir: Path, cache_root: Path) -> Any:
    """``AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)``; after the first
    time, the class it chose, called the way it calls it (no config read)."""
    path = tokenizer_snapshot_path(tokenizer_dir, cache_root) if enabled() else None
    if path is not None:
        try:
            module, _, name = json.loads(path.read_text())["class"].rpartition(".")
        except (OSError, ValueError, KeyError, TypeError):
            pass
        else:
            if module.startswith("transformers."):  # never a class from a model's own code
                import importlib

                cls = getattr(importlib.import_module(module), name, None)
                if cls is not None:
                    return cls.from_pretrained(str(tokenizer_dir), local_files_only=True, _from_auto=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    cls = type(tokenizer)
    if path is not None and cls.__module__.startswith("transformers."):
        try:
            _write_atomically(path, json.dumps({"class": f"{cls.__module__}.{cls.__qualname__}"}))
        except OSError as e:
            logger.debug("tokenizer snapshot: not written to %s: %s", path, e)
    return tokenizer
