"""Plugin discovery and the registries it fills.

Plugins are modules named by entry points of the ``paged`` group (the bundled ones too). Loading
happens once per process (``get_registry()``); the hooks are called here and never again, so the
registries hold plain specs that the engine uses directly.

A plugin that fails to import or whose hook raises is recorded as failed with one warning (its
traceback kept for ``paged plugins --verbose``); the others still load. Two plugins that register
the same name both show as conflicting and the name is left out of the registry: only a command
that selects that name fails (naming both plugins); everything else keeps working.
``PAGED_PLUGINS`` (allow list) and ``PAGED_DISABLE_PLUGINS`` (deny list) are comma-separated
entry-point names.
"""

from __future__ import annotations

import difflib
import importlib.metadata as md
import logging
import os
import traceback
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Iterable

import pluggy

from paged.core.errors import ConfigError, PluginError
from paged.core.quantization import QuantizationMethodSpec
from paged.core.hookspecs import (
    ENTRY_POINT_GROUP,
    PROJECT,
    AttentionBackendSpec,
    LoRAKernelSpec,
    ModelSpec,
    PagedHookSpecs,
    PolicySpec,
    PoolerSpec,
    SpeculativeProposerSpec,
    StructuredOutputBackendSpec,
)

logger = logging.getLogger("paged")

# hook name -> (registry kind shown to users, attribute that names a spec)
_KINDS = {
    "register_policies": ("policies", "name"),
    "register_attention_backends": ("attention_backends", "name"),
    "register_models": ("models", "architecture"),
    "register_structured_output_backends": ("structured_output_backends", "name"),
    "register_quantization_methods": ("quantization_methods", "name"),
    "register_speculative_proposers": ("speculative_proposers", "name"),
    "register_poolers": ("poolers", "name"),
    "register_lora_kernels": ("lora_kernels", "name"),
}


@dataclass
class PluginInfo:
    name: str
    distribution: str | None
    version: str | None
    module: str
    status: str = "ok"  # "ok" | "failed" | "disabled" | "conflict" (loaded, but a name clashes)
    error: str | None = None
    traceback: str | None = None  # of a failure, for `paged plugins --verbose`
    provides: dict[str, list[str]] = field(default_factory=dict)
    conflicts: list[str] = field(default_factory=list)  # "kind 'name' (also registered by 'other')"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "module": self.module,
            "status": self.status,
            "error": self.error,
            "traceback": self.traceback,
            "provides": self.provides,
            "conflicts": self.conflicts,
        }


@dataclass
class Registry:
    """What the loaded plugins provide, by kind and name, and who provided it."""

    policies: dict[str, PolicySpec] = field(default_factory=dict)
    attention_backends: dict[str, AttentionBackendSpec] = field(default_factory=dict)
    models: dict[str, ModelSpec] = field(default_factory=dict)
    structured_output_backends: dict[str, StructuredOutputBackendSpec] = field(default_factory=dict)
    quantization_methods: dict[str, QuantizationMethodSpec] = field(default_factory=dict)
    speculative_proposers: dict[str, SpeculativeProposerSpec] = field(default_factory=dict)
    poolers: dict[str, PoolerSpec] = field(default_factory=dict)
    lora_kernels: dict[str, LoRAKernelSpec] = field(default_factory=dict)
    owner: dict[tuple[str, str], str] = field(default_factory=dict)  # (kind, name) -> plugin
    plugins: list[PluginInfo] = field(default_factory=list)
    # (kind, name) -> every plugin registering it; such names are not in the tables above
    conflicts: dict[tuple[str, str], list[str]] = field(default_factory=dict)

    def _failed_hint(self) -> str:
        failed = [p for p in self.plugins if p.status == "failed"]
        if not failed:
            return ""
        parts = [f"plugin '{p.name}' ({p.distribution or p.module}) failed to load: {p.error}" for p in failed]
        return " Note: " + "; ".join(parts) + "."

    def _lookup(self, kind: str, field_name: str, name: str) -> Any:
        table: dict[str, Any] = getattr(self, kind)
        if name in table:
            return table[name]
        if (kind, name) in self.conflicts:
            owners = self.conflicts[(kind, name)]
            raise PluginError(
                f"{field_name}: {name!r} is registered by several plugins: "
                + " and ".join(f"'{o}'" for o in owners)
                + f". Disable all but one, e.g. PAGED_DISABLE_PLUGINS={','.join(owners[1:])}."
            )
        available = sorted(table)
        close = difflib.get_close_matches(name, available, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"{field_name}: unknown value {name!r}.{hint} Available: {', '.join(available) or '(none)'}."
            + self._failed_hint()
        )

    def policy(self, name: str) -> PolicySpec:
        return self._lookup("policies", "scheduler.policy", name)

    def attention_backend(self, name: str) -> AttentionBackendSpec:
        return self._lookup("attention_backends", "attention.backend", name)

    def structured_output_backend(self, name: str) -> StructuredOutputBackendSpec:
        return self._lookup("structured_output_backends", "structured_output.backend", name)
    def quantization_method(self, name: str) -> QuantizationMethodSpec:
        return self._lookup("quantization_methods", "model.quantization", name)

    def speculative_proposer(self, name: str) -> SpeculativeProposerSpec:
        return self._lookup("speculative_proposers", "speculative.method", name)

    def pooler(self, name: str) -> PoolerSpec:
        return self._lookup("poolers", "pooling.pooler", name)

    def lora_kernel(self, name: str) -> LoRAKernelSpec:
        return self._lookup("lora_kernels", "lora.kernel", name)

    def model(self, architecture: str) -> ModelSpec:
        try:
            return self._lookup("models", "model architecture", architecture)
        except ConfigError as e:
            raise ConfigError(
                str(e).replace("model architecture: unknown value", "model architecture: no plugin provides")
            ) from None


def _comma_list(value: str | None) -> set[str] | None:
    if value is None:
        return None
    return {item.strip() for item in value.split(",") if item.strip()}


def _dist_of(ep: md.EntryPoint, seen: dict[str, tuple[str, str]]) -> tuple[str | None, str | None]:
    """(name, version) of the entry point's distribution. ``seen``: by the distribution's path, as
    each ``metadata`` read parses its METADATA file again (paged's own 8 entry points cost 16
    parses, 0.05 s of every process that loads the plugins, before)."""
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    key = str(getattr(dist, "_path", id(dist)))
    if key not in seen:
        metadata = dist.metadata
        seen[key] = (metadata["Name"], metadata["Version"])
    return seen[key]


def load_plugins(
    entry_points: Iterable[md.EntryPoint] | None = None,
    modules: Iterable[tuple[str, ModuleType]] = (),
    allow: set[str] | None = None,
    deny: set[str] | None = None,
) -> Registry:
    """Load plugins and call each registration hook once per plugin.

    ``entry_points`` defaults to the ``paged`` group; ``modules`` adds (name, module) pairs
    directly (tests, embedding). ``allow``/``deny`` default to PAGED_PLUGINS/PAGED_DISABLE_PLUGINS.
    """
    if entry_points is None:
        entry_points = md.entry_points(group=ENTRY_POINT_GROUP)
    if allow is None:
        allow = _comma_list(os.environ.get("PAGED_PLUGINS"))
    if deny is None:
        deny = _comma_list(os.environ.get("PAGED_DISABLE_PLUGINS")) or set()

    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(PagedHookSpecs)
    registry = Registry()
    loaded: list[tuple[PluginInfo, ModuleType]] = []

    candidates: list[tuple[PluginInfo, Any]] = []
    seen: set[str] = set()
    distributions: dict[str, tuple[str, str]] = {}
    for ep in entry_points:
        if ep.name in seen:  # the same distribution seen twice on sys.path
            continue
        seen.add(ep.name)
        dist, version = _dist_of(ep, distributions)
        candidates.append((PluginInfo(ep.name, dist, version, ep.value), ep))
    for name, module in modules:
        candidates.append((PluginInfo(name, None, None, module.__name__), module))

    for info, source in candidates:
        registry.plugins.append(info)
        if (allow is not None and info.name not in allow) or info.name in deny:
            info.status = "disabled"
            continue
        try:
            module = source.load() if isinstance(source, md.EntryPoint) else source
            pm.register(module, name=info.name)
        except Exception as e:  # a broken plugin must not take the others down
            _fail(info, e, "importing it")
            continue
        loaded.append((info, module))

    for info, module in loaded:
        provided: dict[str, list[tuple[str, Any]]] = {}
        for hook_name, (kind, attr) in _KINDS.items():
            impl = getattr(module, hook_name, None)
            if impl is None:
                continue
            try:
                specs = impl() or []
                provided[kind] = [(getattr(spec, attr), spec) for spec in specs]
            except Exception as e:
                _fail(info, e, f"its hook {hook_name}")
                break
        if info.status == "failed":
            pm.unregister(module)
            continue
        for kind, items in provided.items():
            for name, spec in items:
                _add(registry, info, kind, name, spec)
            info.provides[kind] = [name for name, _ in items]
    return registry


def _add(registry: Registry, info: PluginInfo, kind: str, name: str, spec: Any) -> None:
    """Put ``spec`` in its table, or, when another plugin already claims the name, take the name
    out of the table and record the conflict on both plugins."""
    table = getattr(registry, kind)
    key = (kind, name)
    if key in registry.conflicts:
        registry.conflicts[key].append(info.name)
    elif key in registry.owner:
        registry.conflicts[key] = [registry.owner.pop(key), info.name]
        del table[name]
    else:
        table[name] = spec
        registry.owner[key] = info.name
        return
    owners = registry.conflicts[key]
    by_name = {p.name: p for p in registry.plugins}
    for owner in owners:
        plugin = by_name[owner]
        plugin.status = "conflict"
        others = ", ".join(f"'{o}'" for o in owners if o != owner)
        note = f"{kind} {name!r} (also registered by {others})"
        plugin.conflicts = [c for c in plugin.conflicts if not c.startswith(f"{kind} {name!r} ")] + [note]
    if len(owners) == 2:
        logger.warning(
            "paged plugins %s: %s %r is registered by both; commands that select it fail until one is "
            "disabled (PAGED_DISABLE_PLUGINS)", " and ".join(f"'{o}'" for o in owners), kind, name,
        )


def _fail(info: PluginInfo, error: BaseException, where: str) -> None:
    """Record a failure (``where``: what raised, e.g. "its hook register_policies")."""
    info.status = "failed"
    info.error = f"{where} raised {type(error).__name__}: {error}"
    info.traceback = "".join(traceback.format_exception(error))
    logger.warning(
        "paged plugin '%s' (%s) failed to load: %s (traceback: paged plugins --verbose)",
        info.name, info.module, info.error,
    )


_REGISTRY: Registry | None = None
_REGISTRY_KEY: tuple[str | None, str | None] | None = None


def get_registry() -> Registry:
    """The process-wide registry, loaded on first use (and again if the plugin env vars change)."""
    global _REGISTRY, _REGISTRY_KEY
    key = (os.environ.get("PAGED_PLUGINS"), os.environ.get("PAGED_DISABLE_PLUGINS"))
    if _REGISTRY is None or key != _REGISTRY_KEY:
        _REGISTRY = load_plugins()
        _REGISTRY_KEY = key
    return _REGISTRY
