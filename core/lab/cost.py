"""The step cost model of the simulator: the time of one engine step as a linear function of its
batch shape, fitted by least squares on timed real steps and saved as JSON.

    t = const + b * prefill_tokens + c * decode_tokens + d * num_seqs + e * prefill_seqs
        + f * context_tokens + g * prefill_attention

- ``prefill_tokens``: new tokens of requests that are not decoding (prompt chunks, recompute
  after a preemption); ``decode_tokens``: requests scheduling one token after a computed context;
- ``num_seqs``: requests in the batch (per-request work: sampling, block tables, Python);
- ``prefill_seqs``: requests with a prefill chunk (admission, block allocation, a new detokenizer);
- ``context_tokens``: the tokens every scheduled request attends over (computed + new), thousands;
- ``prefill_attention``: sum over prefill chunks of new x (computed + new) tokens, in millions
  (the quadratic part of prefill attention).

The coefficients are non-negative (an active-set least squares: a feature whose coefficient goes
negative is dropped and the rest refitted), so predictions never fall below ``const``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from paged.core.errors import PagedError

COST_VERSION = 1
FEATURES = ("const", "prefill_tokens", "decode_tokens", "num_seqs", "prefill_seqs", "context_tokens", "prefill_attention")


@dataclass(frozen=True, slots=True)
class BatchShape:
    num_seqs: int
    prefill_tokens: int
    decode_tokens: int
    context_tokens: int
    prefill_attention: int  # sum of new * (computed + new) over prefill chunks
    prefill_seqs: int = 0

    def features(self) -> list[float]:
        return [1.0, float(self.prefill_tokens), float(self.decode_tokens), float(self.num_seqs),
                float(self.prefill_seqs), self.context_tokens / 1e3, self.prefill_attention / 1e6]


def batch_shape(scheduler_output) -> BatchShape:
    """The shape of a ``SchedulerOutput``'s batch."""
    num_seqs = prefill = decode = context = attention = prefill_seqs = 0
    for s in scheduler_output.scheduled:
        num_seqs += 1
        total = s.num_computed_tokens + s.num_new_tokens
        context += total
        if s.num_new_tokens == 1 and s.num_computed_tokens > 0 and s.is_sampled:
            decode += 1
        else:
            prefill += s.num_new_tokens
            prefill_seqs += 1
            attention += s.num_new_tokens * total
    return BatchShape(num_seqs, prefill, decode, context, attention, prefill_seqs)


class CostModelError(PagedError, ValueError):
    """A cost model file is missing or invalid."""


@dataclass
class CostModel:
    coef: list[float]  # seconds per unit of each feature, in FEATURES order
    features: tuple[str, ...] = FEATURES
    clock: str = "wall"  # what the calibration timed: wall | cpu
    fit: dict[str, Any] = field(default_factory=dict)  # quality on the calibration steps
    engine: dict[str, Any] = field(default_factory=dict)  # model and settings it was measured with
    validation: dict[str, Any] = field(default_factory=dict)  # sim vs real on a validation trace

    def predict(self, shape: BatchShape) -> float:
        if not shape.num_seqs:
            return 0.0
        return sum(c * x for c, x in zip(self.coef, shape.features()))

    @classmethod
    def constant(cls, step_s: float) -> "CostModel":
        """Every step takes ``step_s`` (the ``steps`` clock)."""
        return cls([step_s] + [0.0] * (len(FEATURES) - 1), clock="steps")

    def to_dict(self) -> dict[str, Any]:
        return {
            "paged_cost_model": COST_VERSION,
            "formula": "t_step_s = sum(coef[f] * feature[f]); context_tokens in thousands, prefill_attention in millions",
            "clock": self.clock,
            "coef": dict(zip(self.features, self.coef)),
            "fit": self.fit,
            "engine": self.engine,
            "validation": self.validation,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        path = Path(path)
        if not path.is_file():
            raise CostModelError(f"--simulate: no such cost model file {str(path)!r} (make one with `paged lab calibrate`)")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CostModelError(f"--simulate: {str(path)!r} is not JSON ({e})") from None
        if not isinstance(data, dict) or data.get("paged_cost_model") != COST_VERSION or not isinstance(data.get("coef"), dict):
            raise CostModelError(f"--simulate: {str(path)!r} is not a paged cost model (version {COST_VERSION})")
        coef = data["coef"]
        unknown = set(coef) - set(FEATURES)
        if unknown:
            raise CostModelError(f"--simulate: {str(path)!r}: unknown feature(s) {sorted(unknown)}; known: {list(FEATURES)}")
        values = [coef.get(name, 0.0) for name in FEATURES]
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in values):
            raise CostModelError(f"--simulate: {str(path)!r}: coefficients must be finite numbers >= 0")
        return cls([float(v) for v in values], FEATURES, data.get("clock", "wall"), data.get("fit", {}),
                   data.get("engine", {}), data.get("validation", {}))


def _nnls(X, y, w):
    """Active-set non-negative least squares of ``w * (X @ coef - y)``."""
    import numpy as np

    active = [j for j in range(X.shape[1]) if j == 0 or X[:, j].any()]
    coef = np.zeros(X.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(X[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.remove(active[int(np.argmin(sol))])
    return coef


def fit_cost_model(shapes: Sequence[BatchShape], times: Sequence[float], clock: str = "wall",
                   trim: float = 0.05) -> CostModel:
    """Non-negative least squares of step times on batch shapes, minimising relative error
    (each row weighted by 1 / its time, so short decode steps count as much as long prefills).
    Robust to timing noise: after a first fit the ``trim`` share of steps with the largest
    relative residuals (a GC pause, a preempted process) is dropped and the fit repeated. The
    quality figures are over all steps.

    Step times have a heavy right tail (a GC pause, a woken thread, another process), and a
    relative-error fit follows the fast majority, so it predicts too little time in total. The
    fitted shape is therefore rescaled so that its total over all calibration steps equals the
    measured total: latencies in a simulation are sums of step times, and this keeps them unbiased."""
    import numpy as np

    if len(shapes) < len(FEATURES) + 2:
        raise CostModelError(f"calibration: {len(shapes)} timed steps are too few to fit {len(FEATURES)} coefficients")
    X = np.array([s.features() for s in shapes], dtype=np.float64)
    y = np.array(times, dtype=np.float64)
    w = 1.0 / np.maximum(y, 1e-9)
    coef = _nnls(X, y, w)
    if trim > 0:
        rel = np.abs(X @ coef - y) * w
        keep = rel <= np.quantile(rel, 1.0 - trim)
        if keep.sum() >= len(FEATURES) + 2:
            coef = _nnls(X[keep], y[keep], w[keep])
    unscaled_total_error = float((X @ coef).sum() / y.sum() - 1.0)
    coef = coef * (y.sum() / max(float((X @ coef).sum()), 1e-12))
    pred = X @ coef
    residual = pred - y
    ss_tot = float(((y - y.mean()) ** 2).sum())
    rel = np.abs(residual) * w
    fit = {
        "num_steps": int(len(y)),
        "r2": round(1.0 - float((residual**2).sum()) / ss_tot, 4) if ss_tot > 0 else None,
        "mean_abs_rel_error": round(float(rel.mean()), 4),
        "median_abs_rel_error": round(float(np.median(rel)), 4),
        "p90_abs_rel_error": round(float(np.percentile(rel, 90)), 4),
        "total_time_rel_error": round(float(pred.sum() / y.sum() - 1.0), 4),  # 0 by construction
        "unscaled_total_time_rel_error": round(unscaled_total_error, 4),
        "mean_step_s": round(float(y.mean()), 6),
        "trimmed": trim,
    }
    return CostModel([float(c) for c in coef], FEATURES, clock, fit)
