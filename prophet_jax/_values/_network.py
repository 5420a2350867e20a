"""NetworkModel, Pressure, the presets and the alpha-beta line fit (pure numpy; docs/design.md, "Values")."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._errors import NetworkError
from ._types import JsonValue, is_bool, is_finite_nonneg, is_int, nonneg_or_none

ALGORITHMS = ("ring",)

# name: (alpha_s per ring step, beta_s_per_byte). Alpha is the per-message start-up of one ring step
# (software + NIC + switch); beta the inverse of the per-link bandwidth.
PRESETS: dict[str, tuple[float, float]] = {
    "1gbe": (50e-6, 1 / 125e6),
    "10gbe": (25e-6, 1 / 1.25e9),
    "25gbe": (10e-6, 1 / 3.125e9),
    "100gb-ib": (3e-6, 1 / 12.5e9),
    "nvlink": (2e-6, 1 / 150e9),
    "400gb-ib": (5e-6, 1 / 50e9),
}

# Two-level presets, name: (inner preset, outer preset, devices per node): an inner link in a node and
# an outer link across nodes (HSDP, hierarchical plans). NVLink in an 8-GPU node, 400 Gb/s InfiniBand
# (one NIC per GPU) between nodes.
PRESETS_TWO_LEVEL: dict[str, tuple[str, str, int]] = {
    "nvlink+400gb-ib": ("nvlink", "400gb-ib", 8),
}


_INT_NOTES = {"node_size": " (devices per node of a two-level network; 0 for one level)"}


def check_fields(value: Any, floats: tuple[str, ...], ints: dict[str, int]) -> None:
  """Stores `value`'s `floats` as floats (finite, >= 0), its `ints` as ints (>= the least given), or raises."""
  owner = type(value).__name__
  for n in floats:
    v = getattr(value, n)
    if not is_finite_nonneg(v):
      raise NetworkError(f"{owner} has {n}={v!r}; it must be a finite number >= 0.")
    object.__setattr__(value, n, float(v))
  for n, lo in ints.items():
    v = getattr(value, n)
    if not is_int(v) or v < lo:
      raise NetworkError(f"{owner} has {n}={v!r}; it must be an integer >= {lo}{_INT_NOTES.get(n, '')}.")
    object.__setattr__(value, n, int(v))


@dataclass(frozen=True, slots=True, kw_only=True)
class Pressure(JsonValue):
  """Network pressure: seeded background traffic and heavy-tailed per-message delays.

  Each message lasts a + b·nbytes·(1 + n_s) plus Pareto delays on its delayed ring steps
  (docs/design.md, "Network pressure", with the references).

  Attributes:
    background_flows: mean number of competing flows on the bottleneck link (Poisson per sample).
    tail_prob: probability that one ring step is delayed, in [0, 1].
    tail_scale_s: least extra delay of a delayed step, seconds.
    tail_shape: Pareto shape of that delay (> 0; smaller is heavier).
    samples, seed: seeded iterations simulated (>= 1), and their seed (>= 0).

  Raises:
    NetworkError: a field out of its range, named.
  """

  background_flows: float = 0.0
  tail_prob: float = 0.0
  tail_scale_s: float = 0.0
  tail_shape: float = 1.5
  samples: int = 64
  seed: int = 0

  def __post_init__(self):
    check_fields(self, ("background_flows", "tail_prob", "tail_scale_s", "tail_shape"), {"samples": 1, "seed": 0})
    if self.tail_prob > 1:
      raise NetworkError(f"Pressure has tail_prob={self.tail_prob!r}; it is a probability per ring "
                         f"step and must be in [0, 1] (e.g. 0.01).")
    if self.tail_shape <= 0:
      raise NetworkError(f"Pressure has tail_shape={self.tail_shape!r}; the Pareto shape must be > 0 "
                         f"(e.g. 1.5; the smaller, the heavier the tail).")

  @property
  def calm(self) -> bool:
    """True when no parameter adds anything (no background flows, no tail): every sample is calm."""
    return self.background_flows == 0 and (self.tail_prob == 0 or self.tail_scale_s == 0)

  @classmethod
  def from_json(cls, text_or_obj: str | Mapping[str, Any]) -> Pressure:
    return cls(**cls._json_fields(text_or_obj))

@dataclass(frozen=True, slots=True, kw_only=True)
class NetworkModel(JsonValue):
  """Alpha-beta cost of an all-reduce among `workers`.

  Attributes:
    alpha_s: latency per ring step, seconds.
    beta_s_per_byte: seconds per byte on one link (1 / bandwidth).
    workers: number of data-parallel workers P.
    algorithm: 'ring'.
    overlap: whether the device computes while it communicates (True for GPUs, False for XLA on CPU).
    links: parallel paths; chunks go to the earliest free one.
    name: where it came from (a preset name, 'fit', 'probe', ...).
    fit_residual_s: RMS residual of the fit that produced it, seconds, or None.
    skew: without overlap, the slowest worker's lag per unit of compute (0: workers keep pace).
    pressure: a `Pressure`, or None for a calm network.
    node_size: devices per node of a two-level network (0: one level); `outer_alpha_s` and
      `outer_beta_s_per_byte` are then the link across nodes, used by rings spanning nodes.
  """

  alpha_s: float
  beta_s_per_byte: float
  workers: int
  algorithm: str = "ring"
  overlap: bool = True
  links: int = 1
  name: str = ""
  fit_residual_s: float | None = None
  skew: float = 0.0
  pressure: Pressure | None = None
  node_size: int = 0
  outer_alpha_s: float = 0.0
  outer_beta_s_per_byte: float = 0.0

  def __post_init__(self):
    check_fields(self, ("alpha_s", "beta_s_per_byte", "skew", "outer_alpha_s", "outer_beta_s_per_byte"),
                 {"node_size": 0, "workers": 1, "links": 1})
    if not isinstance(self.algorithm, str) or self.algorithm not in ALGORITHMS:
      raise NetworkError(f"NetworkModel has algorithm={self.algorithm!r}; expected one of {ALGORITHMS}.")
    if not is_bool(self.overlap):
      raise NetworkError(f"NetworkModel has overlap={self.overlap!r}; it must be True or False (JSON true or "
                         f"false): whether the device computes while it communicates (True for GPUs, False "
                         f"for XLA on the CPU).")
    object.__setattr__(self, "overlap", bool(self.overlap))
    if not isinstance(self.name, str):
      raise NetworkError(f"NetworkModel has name={self.name!r}; it must be a string (where the model came "
                         f"from, e.g. '25gbe' or 'fit').")
    object.__setattr__(self, "fit_residual_s", nonneg_or_none(self.fit_residual_s, lambda r: NetworkError(
        f"NetworkModel has fit_residual_s={r!r}; it must be a finite number >= 0 (the fit's RMS residual, "
        f"seconds) or None.")))
    if self.pressure is not None and not isinstance(self.pressure, Pressure):
      raise NetworkError(f"NetworkModel has pressure={self.pressure!r}; it must be a Pressure or None "
                         f"(e.g. Pressure(background_flows=0.3, tail_prob=0.01, tail_scale_s=0.002)).")

  def link_costs(self, span: int) -> tuple[float, float]:
    """(alpha_s, beta_s_per_byte) of a ring over `span` consecutive devices: the inner link's within a node,
    else the outer link's.
    """
    if self.node_size and span > self.node_size:
      return self.outer_alpha_s, self.outer_beta_s_per_byte
    return self.alpha_s, self.beta_s_per_byte

  @property
  def startup_s(self) -> float:
    """MG-WFBP's `a`: the fixed cost of one all-reduce, 2(P-1)·alpha_s, seconds."""
    return 2 * (self.workers - 1) * self.link_costs(self.workers)[0]

  @property
  def per_byte_s(self) -> float:
    """MG-WFBP's `b`: seconds per byte of one all-reduce, 2(P-1)/P·beta."""
    return 2 * (self.workers - 1) / self.workers * self.link_costs(self.workers)[1]

  def allreduce_s(self, nbytes: float) -> float:
    """Ring all-reduce time of `nbytes`: 2(P-1)·alpha_s + 2(P-1)/P·nbytes·beta (0 for one worker)."""
    return self.startup_s + self.per_byte_s * nbytes

  def reduce_scatter_s(self, nbytes: float) -> float:
    """Ring reduce-scatter time of a buffer of `nbytes` (the whole buffer), or all-gather time of a result
    of `nbytes` (`all_gather_s`): half an all-reduce, seconds."""
    return 0.5 * self.startup_s + 0.5 * self.per_byte_s * nbytes

  all_gather_s = reduce_scatter_s   # the ring's other half costs the same

  def describe(self) -> str:
    """A short human summary, with what a 1 KiB, 1 MiB and 64 MiB all-reduce take."""
    bw = math.inf if self.beta_s_per_byte == 0 else 1 / self.beta_s_per_byte
    lines = [f"{self.name or 'network'}: {self.workers} workers, alpha {self.alpha_s * 1e6:.2f} us per ring "
             f"step (one all-reduce starts in {self.startup_s * 1e6:.1f} us), beta "
             f"{self.beta_s_per_byte * 1e9:.3f} ns/B ({bw / 1e9:.2f} GB/s per link), overlap {self.overlap}"]
    if self.fit_residual_s is not None:
      lines.append(f"  fit residual (RMS) {self.fit_residual_s * 1e6:.1f} us")
    if self.skew:
      lines.append(f"  skew {self.skew:.3f}: each synchronous all-reduce also waits {self.skew:.1%} of the "
                   f"compute before it")
    if self.pressure is not None:
      q = self.pressure
      lines.append(f"  pressure: {q.background_flows:g} background flows on average; each ring step "
                   f"delayed with probability {q.tail_prob:g} by >= {q.tail_scale_s * 1e3:g} ms (Pareto "
                   f"shape {q.tail_shape:g}); {q.samples} samples, seed {q.seed}")
    for s in (2**10, 2**20, 2**26):
      lines.append(f"  predicted all-reduce of {s / 2**20:g} MiB: {self.allreduce_s(s) * 1e3:.3f} ms")
    return "\n".join(lines)

  def with_workers(self, workers: int) -> NetworkModel:
    return dataclasses.replace(self, workers=workers)

  def replace(self, **changes: Any) -> NetworkModel:
    return dataclasses.replace(self, **changes)

  @classmethod
  def preset(cls, name: str, *, workers: int, overlap: bool = True, links: int = 1) -> NetworkModel:
    """A named interconnect: one of `PRESETS` or `PRESETS_TWO_LEVEL` ('nvlink+400gb-ib')."""
    inner, outer = name, {}
    if isinstance(name, str) and name in PRESETS_TWO_LEVEL:   # the inner preset in a node, the outer across
      inner, across, node = PRESETS_TWO_LEVEL[name]
      outer = dict(node_size=node, outer_alpha_s=PRESETS[across][0], outer_beta_s_per_byte=PRESETS[across][1])
    elif not isinstance(name, str) or name not in PRESETS:
      raise NetworkError(f"unknown network preset {name!r}; expected one of "
                         f"{sorted(PRESETS) + sorted(PRESETS_TWO_LEVEL)}, or a NetworkModel JSON file.")
    alpha, beta = PRESETS[inner]
    return cls(alpha_s=alpha, beta_s_per_byte=beta, workers=workers, overlap=overlap, links=links, name=name,
               **outer)

  @classmethod
  def fit(cls, sizes: Sequence[float], seconds: Sequence[float], *, workers: int,
          overlap: bool = True, name: str = "fit", skew: float = 0.0, warn: bool = True) -> NetworkModel:
    """Least-squares alpha and beta from measured (bytes, seconds) of single all-reduces.

    Fits seconds = a + b·bytes (a, b >= 0, relative error), then alpha_s = a / (2(P-1)), beta =
    b·P / (2(P-1)); warns with `fit_warning`'s text unless `warn` is False. `overlap`, `name` and `skew`
    are carried into the model.

    Raises:
      NetworkError: fewer than 2 distinct sizes, mismatched or non-finite data, workers < 2.
    """
    x = np.asarray(sizes, dtype=np.float64).ravel()
    y = np.asarray(seconds, dtype=np.float64).ravel()
    if x.shape != y.shape:
      raise NetworkError(f"NetworkModel.fit(): got {x.size} sizes but {y.size} times; they must pair up.")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))) or np.any(x < 0) or np.any(y < 0):
      raise NetworkError("NetworkModel.fit(): sizes and times must be finite and >= 0.")
    if len(np.unique(x)) < 2:
      raise NetworkError(f"NetworkModel.fit() needs at least 2 distinct message sizes to fit alpha and "
                         f"beta; got sizes {tuple(np.unique(x).tolist())}.")
    if not is_int(workers) or workers < 2:
      raise NetworkError(f"NetworkModel.fit(workers={workers!r}): a fit needs an integer number of "
                         f"workers >= 2.")
    if not is_bool(warn):
      raise TypeError(f"NetworkModel.fit(warn={warn!r}): `warn` must be True or False.")
    a, b = nonneg_line(x, y)
    resid = float(np.sqrt(np.mean((a + b * x - y) ** 2)))
    p = int(workers)
    net = cls(alpha_s=a / (2 * (p - 1)), beta_s_per_byte=b * p / (2 * (p - 1)), workers=p,
              overlap=overlap, name=name, fit_residual_s=resid, skew=skew)
    if warn:
      text = fit_warning(net, x, y, who="NetworkModel.fit")
      if text is not None:
        warnings.warn(text, UserWarning, stacklevel=2)
    return net

  def to_dict(self) -> dict[str, Any]:
    d = JsonValue.to_dict(self)
    if not self.node_size:   # a one-level network's file is what it was before two levels existed
      del d["node_size"], d["outer_alpha_s"], d["outer_beta_s_per_byte"]
    if self.pressure is None:
      del d["pressure"]      # a calm network's file is what it was before pressure existed
    else:
      d["pressure"] = self.pressure.to_dict()
    return d

  @classmethod
  def from_json(cls, text_or_obj: str | Mapping[str, Any]) -> NetworkModel:
    obj = cls._json_fields(text_or_obj)
    missing = sorted({"alpha_s", "beta_s_per_byte", "workers"} - set(obj))
    if missing:
      raise NetworkError(f"NetworkModel.from_json: missing field(s) {missing}.")
    if obj.get("pressure") is not None:
      if not isinstance(obj["pressure"], Mapping):
        raise NetworkError(f"NetworkModel.from_json: 'pressure' must be an object of Pressure fields "
                           f"or null, got {obj['pressure']!r}.")
      try:
        obj["pressure"] = Pressure.from_json(obj["pressure"])
      except (ValueError, TypeError) as e:
        if isinstance(e, NetworkError):
          raise
        raise NetworkError(f"NetworkModel.from_json: 'pressure': {e}") from e
    return cls(**obj)


def typical_network(network: NetworkModel) -> NetworkModel:
  """The calm network with a typical message's costs under `network.pressure` (docs/design.md, "Network
  pressure"); `network` itself when calm.
  """
  q = network.pressure
  if q is None or q.calm:
    return network
  p = network.workers
  steps = 2 * (p - 1)
  if steps == 0:
    return network.replace(pressure=None)
  delay = q.tail_scale_s * (q.tail_shape / (q.tail_shape - 1) if q.tail_shape > 1 else 2 ** (1 / q.tail_shape))
  startup = network.startup_s + steps * q.tail_prob * delay
  per_byte = network.per_byte_s * (1.0 + q.background_flows)
  return network.replace(alpha_s=startup / steps, beta_s_per_byte=per_byte * p / steps, pressure=None,
                         name=f"{network.name or 'network'} (typical under pressure)")


#: warn when the straight-line fit misses the measured times by this much: its RMS residual against
#: the RMS of the times, or its worst miss at one size relative to that size's time.
RESIDUAL_WARN_REL_RMS = 0.2
RESIDUAL_WARN_WORST = 1.0


def fmt_bytes(n: float) -> str:
  for unit, k in (("MiB", 2**20), ("KiB", 2**10)):
    if n >= k:
      return f"{n / k:g} {unit}"
  return f"{n:g} B"


def fit_warning(network: NetworkModel, sizes: Sequence[float], seconds: Sequence[float], *,
                who: str = "NetworkModel.fit", advice: str = "") -> str | None:
  """A warning text when `network` does not describe the measured (bytes, seconds), else None.

  Times all 0, falling with the size (beta clipped to 0), or off the line (RESIDUAL_WARN_REL_RMS,
  RESIDUAL_WARN_WORST); `who` names the caller, `advice` ends a residual's message.
  """
  x = np.asarray(sizes, np.float64).ravel()
  ys = np.asarray(seconds, np.float64).ravel()
  rms = float(np.sqrt(np.mean(ys ** 2))) if ys.size else 0.0
  if rms == 0:
    return (f"{who}: every measured all-reduce time is 0, so the fitted alpha and beta mean nothing. "
            f"Measure with more repeats or larger sizes.")
  pred = np.asarray([network.allreduce_s(s) for s in x], np.float64)
  if network.beta_s_per_byte == 0 and len(np.unique(x)) > 1 and network.workers > 1:
    slope = float(np.polyfit(x, ys, 1)[0])
    why = (f"the times fall as the size grows (least-squares slope {slope:.3g} s/B)" if slope < 0 else
           "the times barely grow with the size, or a time near 0 outweighs the rest in the relative-error fit")
    order = np.argsort(x)
    return (f"{who}: beta was clipped to 0, so the model says bytes are free (every policy would merge "
            f"everything): {why}; from {ys[order[0]] * 1e6:.1f} us at {fmt_bytes(x[order[0]])} to "
            f"{ys[order[-1]] * 1e6:.1f} us at {fmt_bytes(x[order[-1]])}. An all-reduce's time grows with "
            f"its size: measure larger sizes, with more repeats, on a quieter machine, or check that the "
            f"sizes and times are paired in the same order.")
  resid = float(network.fit_residual_s if network.fit_residual_s is not None
                else np.sqrt(np.mean((pred - ys) ** 2)))
  rel = np.abs(pred - ys) / np.maximum(ys, 1e-12)
  worst = int(np.argmax(rel))
  if resid <= RESIDUAL_WARN_REL_RMS * rms and rel[worst] <= RESIDUAL_WARN_WORST:
    return None
  return (f"{who}: the alpha-beta fit leaves an RMS residual of {resid * 1e6:.1f} us, "
          f"{resid / max(rms, 1e-12):.0%} of the RMS measured time ({rms * 1e6:.1f} us; times from "
          f"{ys.min() * 1e6:.1f} to {ys.max() * 1e6:.1f} us); worst at {fmt_bytes(x[worst])}: "
          f"the model says {pred[worst] * 1e6:.1f} us, measured {ys[worst] * 1e6:.1f} us. The all-reduce "
          f"cost here is not a straight line in the message size (scheduler ticks, cores shared with "
          f"other work, a change of regime between sizes), so predictions and plans from this model "
          f"are off by about that much.{(' ' + advice) if advice else ''}")


def nonneg_line(x: np.ndarray, y: np.ndarray, *, relative: bool = True) -> tuple[float, float]:
  """Least squares (a, b) of y = a + b·x with a, b >= 0; `relative` weighs points by 1/y."""
  w = (1.0 / np.maximum(y, max(float(np.max(y)) * 1e-9, 1e-300)) if relative
       else np.ones_like(y, dtype=float))
  A = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
  (a, b), *_ = np.linalg.lstsq(A, y * w, rcond=None)
  if a >= 0 and b >= 0:
    return float(a), float(b)
  cands = [(float(np.sum(w * w * y) / np.sum(w * w)), 0.0),
           (0.0, max(float(np.sum(w * w * x * y) / max(np.sum(w * w * x * x), 1e-300)), 0.0))]
  return min(cands, key=lambda ab: float(np.sum((w * (ab[0] + ab[1] * x - y)) ** 2)))
