"""Warnings about how far a cost model can be trusted: a poor validation fit, and a simulation
asked for settings outside those it was calibrated with (the linear model then extrapolates)."""

from __future__ import annotations

from typing import Any

POOR_FIT = 0.25  # |relative error| of a validated mean latency above which the fit is called poor

# engine setting -> its config location; the simulation extrapolates when it asks for more
_RANGE_SETTINGS = {
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "max_model_len": ("model", "max_model_len"),
}


def poor_fit_warnings(validation: dict[str, Any] | None) -> list[str]:
    """One warning naming every mean latency the simulation missed by more than 25%."""
    errors = (validation or {}).get("rel_errors") or {}
    bad = {k: v for k, v in errors.items() if v is not None and abs(v) > POOR_FIT}
    if not bad:
        return []
    misses = ", ".join(f"{k} {100 * v:+.0f}%" for k, v in bad.items())
    return [
        f"poor fit: the simulation misses the real engine's {misses} (more than {100 * POOR_FIT:.0f}%); do not "
        "trust simulated latencies from this cost model. Calibrate again with the settings you will simulate, "
        "--clock cpu on a busy machine, or a larger --scale"
    ]


def calibration_range_warnings(engine: dict[str, Any] | None, config: Any) -> list[str]:
    """Settings of ``config`` beyond those of the calibrated engine (``cost.engine``)."""
    engine = engine or {}
    out = []
    for key, (section, field) in _RANGE_SETTINGS.items():
        calibrated = engine.get(key)
        wanted = getattr(getattr(config, section), field)
        if calibrated is not None and wanted is not None and wanted > calibrated:
            out.append(f"{section}.{field} {wanted} is beyond the calibrated {calibrated}")
    dtype = config.model.dtype
    if dtype != "auto" and engine.get("dtype") and engine["dtype"].replace("torch.", "") != dtype:
        out.append(f"model.dtype {dtype} differs from the calibrated {engine['dtype'].replace('torch.', '')}")
    backend = config.attention.backend
    if backend != "auto" and engine.get("attention") and engine["attention"] != backend:
        out.append(f"attention.backend {backend} differs from the calibrated {engine['attention']}")
    if not out:
        return []
    return ["the simulation extrapolates the cost model: " + "; ".join(out)
            + ". Calibrate with these settings (`paged lab calibrate` with the same flags) for trustworthy figures"]
