"""The network model: NetworkModel (alpha-beta cost of an all-reduce), Pressure, the presets, and the
alpha-beta line fit that makes a NetworkModel from measured times (`nonneg_line`).

Pure: numpy only, never jax. Measuring a network (the probe) is `_probe`'s.
"""

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

__all__ = ["NetworkModel", "Pressure", "PRESETS", "PRESETS_TWO_LEVEL", "ALGORITHMS", "nonneg_line", "typical_network",
           "fit_warning",
           "RESIDUAL_WARN_REL_RMS", "RESIDUAL_WARN_WORST"]

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


@dataclass(frozen=True, slots=True, kw_only=True)
class Pressure(JsonValue):
  """Network pressure: seeded background traffic and heavy-tailed per-message delays.

  A calm `NetworkModel` gives every all-reduce the same alpha-beta time. A shared network does not:
  other jobs' flows take part of the bandwidth, and a few messages take far longer than the rest
  (losses and retransmission timeouts, incast, congestion pauses, a descheduled NIC thread). In a
  synchronous step one late message delays everything queued behind it, so the tail, not the mean
  bandwidth, sets the step time: the premise of DLCP/MLT (which stop waiting for the least important
  late packets) and of OptiReduce (which bounds a collective's time because its measured completion
  times in shared clouds have a long tail). `simulate` draws `samples` iterations of the exact
  engine under this model and reports their mean (`SimResult.iteration_s`) and tail
  (`iteration_p50_s`, `iteration_p99_s`).

  The model, per simulated iteration s (a sample) and per message k (one all-reduce, in issue order):

    duration(s, k) = a + b·nbytes_k·(1 + n_s) + sum of h(s, k) Pareto delays,

  where a + b·nbytes is the calm time (`NetworkModel.allreduce_s`), n_s ~ Poisson(background_flows)
  is drawn once per iteration, and h(s, k) ~ Binomial(2(P-1), tail_prob) is the number of the
  message's 2(P-1) ring steps that hit a delay, each delay tail_scale_s·U^(-1/tail_shape) (a Pareto
  with minimum tail_scale_s and shape tail_shape; U uniform on (0, 1]). Durations only grow under
  pressure, so `lower_bound` stays valid per sample.

  Attributes:
    background_flows: the mean number of other flows sharing the bottleneck link during an
      iteration (other jobs or tenants). Links are shared fairly (max-min), so with n competing flows
      a message gets 1/(1 + n) of the bandwidth: its bytes take (1 + n) times longer; the start-up
      (latency) is not affected. n is Poisson-distributed, drawn per iteration (background traffic
      changes on a time scale of iterations, not of single messages). 0: a dedicated network.
    tail_prob: the probability that one ring step (a point-to-point transfer between neighbours)
      is delayed: a loss and its retransmission timeout, a congestion pause, a straggling peer. An
      all-reduce among P workers has 2(P-1) steps, so its chance of a delay grows with P (the tail
      at scale). A probability in [0, 1].
    tail_scale_s: the least extra delay of a delayed step, seconds (e.g. a retransmission timeout
      of a few milliseconds in a data center; 200 ms is Linux TCP's default minimum).
    tail_shape: the Pareto shape of the extra delay (> 0): the smaller, the heavier the tail (at
      most 2: infinite variance; at most 1: infinite mean, so the mean over samples never settles).
      1.5, the default, is a heavy tail with a finite mean.
    samples: the number of seeded iterations simulated (>= 1); their mean is the predicted
      iteration, so more samples give a steadier mean (cost: linear in samples).
    seed: the random seed (an integer >= 0): the same seed gives the same samples, so a
      simulation under pressure is deterministic. The background draws depend only on the seed and
      `samples`, not on the schedule, so every policy meets the same background (common random
      numbers); the tail draws follow the schedule's messages in issue order.

  Raises:
    NetworkError: a negative or non-finite parameter, tail_prob outside [0, 1], tail_shape <= 0,
      samples < 1 or a negative seed (the message names the field and the value).

  References:
    H. Wang et al. Domain-specific communication optimization for distributed DNN training (DLCP).
    arXiv:2008.08445, 2020; published as MLT (NSDI 2024).
    E. Warraich et al. OptiReduce: Resilient and tail-optimal AllReduce for distributed deep
    learning in the cloud. NSDI 2025.
    J. Dean, L. A. Barroso. The tail at scale. CACM 2013.
  """

  background_flows: float = 0.0
  tail_prob: float = 0.0
  tail_scale_s: float = 0.0
  tail_shape: float = 1.5
  samples: int = 64
  seed: int = 0

  def __post_init__(self):
    for n in ("background_flows", "tail_prob", "tail_scale_s", "tail_shape"):
      v = getattr(self, n)
      if not is_finite_nonneg(v):
        raise NetworkError(f"Pressure has {n}={v!r}; it must be a finite number >= 0.")
      object.__setattr__(self, n, float(v))
    if self.tail_prob > 1:
      raise NetworkError(f"Pressure has tail_prob={self.tail_prob!r}; it is a probability per ring "
                         f"step and must be in [0, 1] (e.g. 0.01).")
    if self.tail_shape <= 0:
      raise NetworkError(f"Pressure has tail_shape={self.tail_shape!r}; the Pareto shape must be > 0 "
                         f"(e.g. 1.5; the smaller, the heavier the tail).")
    for n, lo in (("samples", 1), ("seed", 0)):
      v = getattr(self, n)
      if not is_int(v) or v < lo:
        raise NetworkError(f"Pressure has {n}={v!r}; it must be an integer >= {lo}.")
      object.__setattr__(self, n, int(v))

  @property
  def calm(self) -> bool:
    """True when no parameter adds anything (no background flows, no tail): every sample is calm."""
    return self.background_flows == 0 and (self.tail_prob == 0 or self.tail_scale_s == 0)

  def to_dict(self) -> dict[str, Any]:
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  @classmethod
  def from_json(cls, text_or_obj: str | Mapping[str, Any]) -> Pressure:
    obj = cls._json_fields(text_or_obj)
    return cls(**obj)

@dataclass(frozen=True, slots=True, kw_only=True)
class NetworkModel(JsonValue):
  """Alpha-beta cost of an all-reduce among `workers`.

  Attributes:
    alpha_s: latency per ring step, seconds.
    beta_s_per_byte: seconds per byte on one link (1 / bandwidth).
    workers: number of data-parallel workers P.
    algorithm: 'ring'.
    overlap: whether the device computes while it communicates (True for GPUs; False for XLA on the
      CPU, where a collective blocks the executor).
    links: parallel paths; chunks go to the earliest free one.
    name: where it came from (a preset name, 'fit', 'probe', ...).
    fit_residual_s: RMS residual of the least-squares fit that produced it, if any.
    skew: with `overlap` False, a synchronous all-reduce also waits for the slowest worker, which
      falls behind by `skew` times the compute done since the previous all-reduce (0: workers keep
      pace, as dedicated devices do; `measure_network` measures it where devices share cores, e.g.
      8 host devices on 2 CPU cores). Ignored when `overlap` is True.
    pressure: background traffic and heavy-tailed delays (`Pressure`), or None for a calm network.
      With it, `simulate` reports the mean over seeded samples and their tail; see `Pressure`.
    node_size: devices per node for a two-level network (0: one level, every link alike). Then
      `alpha_s`/`beta_s_per_byte` are the inner link's (in a node) and `outer_alpha_s`/
      `outer_beta_s_per_byte` the outer link's (across nodes); a ring that spans more than one node is
      costed on the outer link (its slowest hop), so `allreduce_s` among `workers > node_size` uses
      the outer terms (`link_costs`).
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
    for n in ("alpha_s", "beta_s_per_byte", "skew", "outer_alpha_s", "outer_beta_s_per_byte"):
      v = getattr(self, n)
      if not is_finite_nonneg(v):
        raise NetworkError(f"NetworkModel has {n}={v!r}; it must be a finite number >= 0.")
      object.__setattr__(self, n, float(v))
    if not is_int(self.node_size) or self.node_size < 0:
      raise NetworkError(f"NetworkModel has node_size={self.node_size!r}; it must be an integer >= 0 "
                         f"(devices per node of a two-level network; 0 for one level).")
    object.__setattr__(self, "node_size", int(self.node_size))
    for n in ("workers", "links"):
      v = getattr(self, n)
      if not is_int(v) or v < 1:
        raise NetworkError(f"NetworkModel has {n}={v!r}; it must be an integer >= 1.")
      object.__setattr__(self, n, int(v))
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
    """(alpha_s, beta_s_per_byte) of a ring whose members span `span` consecutive devices: the inner
    link's when it stays in one node (or the network has one level), else the outer link's."""
    if self.node_size and span > self.node_size:
      return self.outer_alpha_s, self.outer_beta_s_per_byte
    return self.alpha_s, self.beta_s_per_byte

  @property
  def startup_s(self) -> float:
    """MG-WFBP's `a`: the fixed cost of one all-reduce, 2(P-1)·alpha_s (a two-level network: the
    outer link's alpha when the ring spans nodes)."""
    return 2 * (self.workers - 1) * self.link_costs(self.workers)[0]

  @property
  def per_byte_s(self) -> float:
    """MG-WFBP's `b`: seconds per byte of one all-reduce, 2(P-1)/P·beta (a two-level network: the outer
    link's beta when the ring spans nodes)."""
    return 2 * (self.workers - 1) / self.workers * self.link_costs(self.workers)[1]

  def allreduce_s(self, nbytes: float) -> float:
    """Ring all-reduce time of `nbytes`: 2(P-1)·alpha_s + 2(P-1)/P·nbytes·beta (0 for one worker)."""
    return self.startup_s + self.per_byte_s * nbytes

  def reduce_scatter_s(self, nbytes: float) -> float:
    """Ring reduce-scatter time of a buffer of `nbytes` (the full buffer, each device keeping 1/P):
    (P-1)·alpha_s + (P-1)/P·nbytes·beta, the first half of a ring all-reduce (0 for one worker)."""
    return 0.5 * self.startup_s + 0.5 * self.per_byte_s * nbytes

  def all_gather_s(self, nbytes: float) -> float:
    """Ring all-gather time of a buffer of `nbytes` (the full result, each device contributing 1/P):
    (P-1)·alpha_s + (P-1)/P·nbytes·beta, the second half of a ring all-reduce, so
    `reduce_scatter_s(n) + all_gather_s(n) == allreduce_s(n)` (0 for one worker)."""
    return 0.5 * self.startup_s + 0.5 * self.per_byte_s * nbytes

  def describe(self) -> str:
    """A short human summary: alpha, beta, overlap, the fit's residual and skew, and what a 1 KiB,
    1 MiB and 64 MiB all-reduce would take."""
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
    """A named interconnect: one of `PRESETS` ('1gbe', '10gbe', '25gbe', '100gb-ib', 'nvlink',
    '400gb-ib') or of `PRESETS_TWO_LEVEL` ('nvlink+400gb-ib': NVLink in 8-GPU nodes, 400 Gb/s
    InfiniBand across them)."""
    if isinstance(name, str) and name in PRESETS_TWO_LEVEL:
      inner, outer, node = PRESETS_TWO_LEVEL[name]
      (a_in, b_in), (a_out, b_out) = PRESETS[inner], PRESETS[outer]
      return cls(alpha_s=a_in, beta_s_per_byte=b_in, workers=workers, overlap=overlap, links=links,
                 name=name, node_size=node, outer_alpha_s=a_out, outer_beta_s_per_byte=b_out)
    if not isinstance(name, str) or name not in PRESETS:
      raise NetworkError(f"unknown network preset {name!r}; expected one of "
                         f"{sorted(PRESETS) + sorted(PRESETS_TWO_LEVEL)}, or a NetworkModel JSON file.")
    alpha, beta = PRESETS[name]
    return cls(alpha_s=alpha, beta_s_per_byte=beta, workers=workers, overlap=overlap, links=links,
               name=name)

  @classmethod
  def fit(cls, sizes: Sequence[float], seconds: Sequence[float], *, workers: int,
          overlap: bool = True, name: str = "fit", skew: float = 0.0, warn: bool = True) -> NetworkModel:
    """Least-squares alpha and beta from measured (bytes, seconds) of single all-reduces.

    `skew` (measured apart, see the class) is carried into the model unchanged.

    Fits seconds = a + b·bytes (a, b >= 0) in relative error, then alpha_s = a / (2(P-1)), beta = b·P / (2(P-1)).
    The RMS residual is kept in `fit_residual_s`.

    A fit that does not describe the times warns (UserWarning, the text of `fit_warning`, as
    `measure_network` does): times that fall as the size grows (beta clipped to 0: bytes would be
    free), every time 0, or a residual above a fifth of the times (or a size missed by more than its
    own time). `warn=False` leaves the check to the caller.

    Raises:
      NetworkError: fewer than 2 distinct sizes, mismatched lengths, non-finite data, workers < 2, a
        non-boolean `overlap`.
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
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
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
  """The calm network whose all-reduce costs are a typical message's under `network.pressure`.

  Its start-up is a' = a + 2(P-1)·tail_prob·E[delay] (the expected tail delay of one message's 2(P-1)
  ring steps; E[delay] = tail_scale_s·shape/(shape - 1) for a Pareto shape above 1, the median
  tail_scale_s·2^(1/shape) otherwise, where the mean is infinite) and its per-byte cost
  b' = b·(1 + background_flows) (the mean bandwidth share): one deterministic number per message for
  the planning decisions that need one (how large a block, how many messages), while the simulation
  and the planners' final scores draw the seeded samples. `network` itself when it is calm.
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


def _fmt_bytes(n: float) -> str:
  for unit, k in (("MiB", 2**20), ("KiB", 2**10)):
    if n >= k:
      return f"{n / k:g} {unit}"
  return f"{n:g} B"


def fit_warning(network: NetworkModel, sizes: Sequence[float], seconds: Sequence[float], *,
                who: str = "NetworkModel.fit", advice: str = "") -> str | None:
  """A warning text when the fitted `network` does not describe the measured (bytes, seconds), else None.

  The model says one all-reduce of M bytes costs 2(P-1)·alpha + 2(P-1)/P·M·beta: a straight line in M
  with a slope >= 0. Three ways measured times break it, each of which makes plans and predictions
  wrong: every time is 0 (nothing was measured); the times fall as the size grows (the fit clips beta
  to 0, so the model says bytes are free and every policy merges everything); or they are not on a
  line (the RMS residual above `RESIDUAL_WARN_REL_RMS` of the RMS time, or one size missed by more than
  `RESIDUAL_WARN_WORST` times its own time).

  Args:
    network: the fitted model (its `fit_residual_s` is used when set).
    sizes, seconds: the measured message sizes (bytes) and times.
    who: the caller, as the message names it ('NetworkModel.fit', 'measure_network').
    advice: what to do about a residual, appended to that message.
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
            f"everything): {why}; from {ys[order[0]] * 1e6:.1f} us at {_fmt_bytes(x[order[0]])} to "
            f"{ys[order[-1]] * 1e6:.1f} us at {_fmt_bytes(x[order[-1]])}. An all-reduce's time grows with "
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
          f"{ys.min() * 1e6:.1f} to {ys.max() * 1e6:.1f} us); worst at {_fmt_bytes(x[worst])}: "
          f"the model says {pred[worst] * 1e6:.1f} us, measured {ys[worst] * 1e6:.1f} us. The all-reduce "
          f"cost here is not a straight line in the message size (scheduler ticks, cores shared with "
          f"other work, a change of regime between sizes), so predictions and plans from this model "
          f"are off by about that much.{(' ' + advice) if advice else ''}")


def nonneg_line(x: np.ndarray, y: np.ndarray, *, relative: bool = True) -> tuple[float, float]:
  """Least squares y = a + b x with a, b >= 0 (the interior solution, else the better of the two
  edges a = 0 and b = 0): the one alpha-beta line fit (`NetworkModel.fit`, `models.fit_allreduce`).

  Args:
    x, y: message sizes and times.
    relative: weigh each point by 1/y, so the squares are relative errors: sizes span decades, and
      unweighted squares let the largest messages decide alpha alone (the probe's fit). False: plain
      squares (a fit that reproduces how an author fitted their own timings).
  """
  w = (1.0 / np.maximum(y, max(float(np.max(y)) * 1e-9, 1e-300)) if relative
       else np.ones_like(y, dtype=float))
  A = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
  (a, b), *_ = np.linalg.lstsq(A, y * w, rcond=None)
  if a >= 0 and b >= 0:
    return float(a), float(b)
  cands = [(float(np.sum(w * w * y) / np.sum(w * w)), 0.0),
           (0.0, max(float(np.sum(w * w * x * y) / max(np.sum(w * w * x * x), 1e-300)), 0.0))]
  return min(cands, key=lambda ab: float(np.sum((w * (ab[0] + ab[1] * x - y)) ** 2)))
