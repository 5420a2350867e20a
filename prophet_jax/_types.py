"""The measured values of the pipeline: GradientProfile (with its ProfileRows) and NetworkModel.

Pure: numpy only, never jax. Every value checks its invariants on construction and round-trips through
JSON (`to_json()` / `from_json()`), so a bad file fails where it is read, naming the field at fault.
The planned and simulated values live beside their makers: Chunk, Bucket and Schedule in `_schedule`,
SimResult and Event in `_simulate` (re-exported here under their old names). `itemsize`, the JSON
helpers and `check_values` (the argument checks of every entry point) are shared.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._errors import NetworkError, ProfileError
from ._tree import dtype_name, flatten_with_paths, is_reduced_leaf, layer_of, remember, rows_info

PROFILE_SCHEMA = 1
PROFILE_METHODS = ("measured", "timed", "estimated")
ALGORITHMS = ("ring",)

# GradientProfile.tree_rows, memoized by the profile's identity (see `_tree.rows_info`)
_PROFILE_ROWS: dict[int, tuple[Any, Any]] = {}

_ITEMSIZE = {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "float0": 0}


def itemsize(dtype: str) -> int:
  """Bytes per element of a dtype name ('float32', 'bfloat16', ...), without importing jax."""
  if dtype in _ITEMSIZE:
    return _ITEMSIZE[dtype]
  try:
    return int(np.dtype(dtype).itemsize)
  except TypeError as e:
    raise ValueError(f"unknown dtype {dtype!r}; expected a numpy dtype name or 'bfloat16'") from e


def _finite_nonneg(owner: str, name: str, value: float) -> float:
  value = float(value)
  if not math.isfinite(value) or value < 0:
    raise ProfileError(f"{owner} has {name}={value!r}; {name} must be finite and >= 0.")
  return value


def _loads(text_or_obj: str | Mapping[str, Any], what: str) -> dict[str, Any]:
  if isinstance(text_or_obj, Mapping):
    return dict(text_or_obj)
  try:
    obj = json.loads(text_or_obj)
  except json.JSONDecodeError as e:
    raise ValueError(f"{what}.from_json: malformed JSON ({e.msg} at line {e.lineno} col {e.colno}).") from e
  if not isinstance(obj, dict):
    raise ValueError(f"{what}.from_json: expected a JSON object, got {type(obj).__name__}.")
  return obj


def _fields(cls: type, obj: dict[str, Any], what: str, *, required: bool = False) -> dict[str, Any]:
  """`obj`, checked to hold only fields of the dataclass `cls` (and, with `required`, every field
  without a default)."""
  fields = dataclasses.fields(cls)
  names = {f.name for f in fields}
  unknown = sorted(set(obj) - names)
  if unknown:
    raise ValueError(f"{what}.from_json: unknown field(s) {unknown}; expected some of {sorted(names)}.")
  if required:
    missing = sorted(f.name for f in fields if f.name not in obj and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    if missing:
      raise ValueError(f"{what}.from_json: missing field(s) {missing}.")
  return obj


# --------------------------------------------------------------------------------------------------
# GradientProfile


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileRow:
  """One reduced gradient leaf.

  Attributes:
    path: canonical key path of the leaf, e.g. 'params/Conv_0/kernel' (rows map to leaves by path).
    layer: the layer it belongs to (wfbp sends one all-reduce per layer).
    shape: the leaf's shape.
    dtype: the gradient's dtype name.
    nbytes: size in bytes; must equal prod(shape) * itemsize(dtype).
    ready_s: when backward has produced it, seconds from the start of backward.
    fwd_s: forward time of its layer, carried on the layer's first row (0 on the others).
    update_s: optimizer time for this leaf (0 when unknown).
  """

  path: str
  layer: str
  shape: tuple[int, ...]
  dtype: str
  nbytes: int
  ready_s: float
  fwd_s: float = 0.0
  update_s: float = 0.0

  def __post_init__(self):
    if not isinstance(self.path, str) or not self.path:
      raise ProfileError(f"a profile row has path={self.path!r}; paths must be non-empty strings.")
    object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
    if any(d < 0 for d in self.shape):
      raise ProfileError(f"leaf {self.path!r} has shape {self.shape}; dimensions must be >= 0.")
    expected = int(np.prod(self.shape, dtype=np.int64)) * itemsize(self.dtype)
    if int(self.nbytes) != expected:
      raise ProfileError(
          f"leaf {self.path!r} has nbytes={self.nbytes}; shape {self.shape} of {self.dtype} holds "
          f"{expected} bytes.")
    object.__setattr__(self, "nbytes", int(self.nbytes))
    for name in ("ready_s", "fwd_s", "update_s"):
      object.__setattr__(self, name, _finite_nonneg(f"leaf {self.path!r}", name, getattr(self, name)))

  @property
  def size(self) -> int:
    """Number of elements."""
    return int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True, slots=True, kw_only=True)
class GradientProfile:
  """Per-leaf gradient readiness of one training step, rows in priority (forward) order.

  Row 0 is the leaf the next forward pass needs first. Integer and float0 leaves are not rows.

  Attributes:
    rows: one ProfileRow per reduced leaf, in priority order.
    forward_s: forward time of the whole step (the sum of the rows' fwd_s when those are known).
    backward_s: backward time; every ready_s is <= backward_s.
    method: 'measured' (profiler trace of the real step), 'timed' (per-layer vjp timing) or
      'estimated' (from FLOPs).
    model, device, notes: free text saying what was profiled and how.
    schema: format version.
  """

  rows: tuple[ProfileRow, ...]
  forward_s: float
  backward_s: float
  method: str = "estimated"
  model: str = ""
  device: str = ""
  notes: str = ""
  schema: int = PROFILE_SCHEMA

  def __post_init__(self):
    object.__setattr__(self, "rows", tuple(self.rows))
    if not self.rows:
      raise ProfileError("the profile is empty: it needs at least one gradient row.")
    if self.method not in PROFILE_METHODS:
      raise ProfileError(f"profile has method={self.method!r}; expected one of {PROFILE_METHODS}.")
    if self.schema != PROFILE_SCHEMA:
      raise ProfileError(f"profile has schema={self.schema!r}; this version reads {PROFILE_SCHEMA}.")
    for name in ("forward_s", "backward_s"):
      object.__setattr__(self, name, _finite_nonneg("the profile", name, getattr(self, name)))
    paths = [r.path for r in self.rows]
    if len(set(paths)) != len(paths):
      dup = next(p for p in paths if paths.count(p) > 1)
      raise ProfileError(f"leaf {dup!r} appears twice in the profile; paths must be unique.")
    tol = 1e-9 + 1e-6 * self.backward_s
    for r in self.rows:
      if r.ready_s > self.backward_s + tol:
        raise ProfileError(
            f"leaf {r.path!r} has ready_s={r.ready_s}; ready times must be <= backward_s="
            f"{self.backward_s}.")
    fwd = sum(r.fwd_s for r in self.rows)
    if fwd > 0 and abs(fwd - self.forward_s) > 1e-9 + 1e-6 * self.forward_s:
      raise ProfileError(
          f"the rows' fwd_s sum to {fwd}, but forward_s={self.forward_s}; they must agree (or leave "
          f"every fwd_s at 0).")

  # -- derived --------------------------------------------------------------------------------------
  @property
  def total_nbytes(self) -> int:
    return sum(r.nbytes for r in self.rows)

  @property
  def update_s(self) -> float:
    return sum(r.update_s for r in self.rows)

  @property
  def compute_s(self) -> float:
    """forward + backward + update: the iteration time with free communication."""
    return self.forward_s + self.backward_s + self.update_s

  @property
  def layers(self) -> tuple[str, ...]:
    """Layer names in order of first appearance (priority order)."""
    return tuple(dict.fromkeys(r.layer for r in self.rows))

  def layer_fwd_s(self) -> dict[str, float]:
    """Forward time per layer; with no per-row forward times, all of forward_s on the first layer."""
    out = dict.fromkeys(self.layers, 0.0)
    for r in self.rows:
      out[r.layer] += r.fwd_s
    if self.forward_s > 0 and not any(out.values()):
      out[self.layers[0]] = self.forward_s
    return out

  def ready_order(self) -> tuple[int, ...]:
    """Row indices sorted by ready time (ties: later rows first, as backward runs back to front)."""
    return tuple(sorted(range(len(self.rows)), key=lambda i: (self.rows[i].ready_s, -i)))

  def tree_rows(self) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    """(path, shape, dtype) of every row, in order: what a Schedule for this profile records."""
    hit = _PROFILE_ROWS.get(id(self))
    if hit is not None and hit[0] is self:
      return hit[1]
    rows = rows_info(tuple((r.path, r.shape, r.dtype) for r in self.rows)).rows
    remember(_PROFILE_ROWS, self, rows)
    return rows

  def fingerprint(self) -> str:
    """The tree fingerprint of `tree_rows()` (what `Schedule.tree_fingerprint` must equal)."""
    return rows_info(self.tree_rows()).fingerprint

  def describe(self, max_rows: int = 8) -> str:
    """A short human summary: totals, how it was made, and the first rows in ready order."""
    order = self.ready_order()
    return "\n".join([
        f"{self.model or 'profile'} on {self.device or '?'} ({self.method}): {len(self.rows)} gradients in "
        f"{len(self.layers)} layers, {self.total_nbytes / 2**20:.3f} MiB; forward {self.forward_s * 1e3:.3f} "
        f"ms, backward {self.backward_s * 1e3:.3f} ms, update {self.update_s * 1e3:.3f} ms",
        f"  {self.notes}",
        f"  ready order (first {max_rows}): " + ", ".join(
            f"{self.rows[i].path} @{self.rows[i].ready_s * 1e3:.3f}ms" for i in order[:max_rows])])

  def scaled(self, compute: float) -> GradientProfile:
    """The same profile with every time multiplied by `compute` (a faster or slower device)."""
    rows = tuple(dataclasses.replace(r, ready_s=r.ready_s * compute, fwd_s=r.fwd_s * compute,
                                     update_s=r.update_s * compute) for r in self.rows)
    return dataclasses.replace(self, rows=rows, forward_s=self.forward_s * compute,
                               backward_s=self.backward_s * compute)

  # -- construction ---------------------------------------------------------------------------------
  @classmethod
  def from_rows(cls, rows: Iterable[Mapping[str, Any] | ProfileRow], **kw) -> GradientProfile:
    return cls(rows=tuple(r if isinstance(r, ProfileRow) else ProfileRow(**_row_kwargs(r)) for r in rows),
               **kw)

  @classmethod
  def from_params(cls, params: Any, *, forward_s: float = 0.0, backward_s: float = 0.0,
                  update_s_per_byte: float = 0.0, layer_depth: int | None = None, model: str = "",
                  device: str = "") -> GradientProfile:
    """A profile from a parameter pytree alone: exact paths, shapes and sizes; estimated times.

    Leaves are taken in flatten order (taken as forward order). Times are spread over layers in
    proportion to their bytes; ready times fall back to front (the last layer is ready first).
    Integer and float0 leaves are skipped (they are not reduced).

    Args:
      params: a pytree of arrays (or anything with .shape and .dtype).
      forward_s, backward_s: step times in seconds to spread over the layers.
      update_s_per_byte: optimizer time per gradient byte.
      layer_depth: key-path components that name a layer (default: all but the last).
      model, device: recorded in the profile.
    """
    leaves = [(path, layer_of(path, layer_depth), tuple(leaf.shape), dtype_name(leaf.dtype))
              for path, leaf in flatten_with_paths(params) if is_reduced_leaf(leaf)]
    if not leaves:
      raise ProfileError("from_params: the tree has no floating-point leaves to reduce.")
    nbytes = [int(np.prod(s, dtype=np.int64)) * itemsize(d) for _, _, s, d in leaves]
    total = max(sum(nbytes), 1)
    layer_bytes: dict[str, int] = {}
    for (_, layer, _, _), b in zip(leaves, nbytes):
      layer_bytes[layer] = layer_bytes.get(layer, 0) + b
    layers = list(layer_bytes)
    ready_of, t = {}, 0.0
    for layer in reversed(layers):  # backward runs from the last layer to the first
      t += backward_s * layer_bytes[layer] / total
      ready_of[layer] = min(t, backward_s)
    rows, seen = [], set()
    for (path, layer, shape, dtype), b in zip(leaves, nbytes):
      fwd = forward_s * layer_bytes[layer] / total if layer not in seen else 0.0
      seen.add(layer)
      rows.append(ProfileRow(path=path, layer=layer, shape=shape, dtype=dtype, nbytes=b,
                             ready_s=ready_of[layer], fwd_s=fwd, update_s=update_s_per_byte * b))
    fsum = sum(r.fwd_s for r in rows)
    return cls(rows=tuple(rows), forward_s=fsum if fsum > 0 else forward_s, backward_s=backward_s,
               method="estimated", model=model, device=device,
               notes="from_params: sizes exact; times spread over layers by bytes")

  # -- JSON -----------------------------------------------------------------------------------------
  def to_dict(self) -> dict[str, Any]:
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "rows"}
    d["rows"] = [dataclasses.asdict(r) | {"shape": list(r.shape)} for r in self.rows]
    return d

  def to_json(self, indent: int | None = None) -> str:
    return json.dumps(self.to_dict(), indent=indent)

  @classmethod
  def from_json(cls, text_or_obj: str | Mapping[str, Any]) -> GradientProfile:
    obj = _fields(cls, _loads(text_or_obj, "GradientProfile"), "GradientProfile")
    if not isinstance(obj.get("rows"), list):
      raise ProfileError("GradientProfile.from_json: field 'rows' must be a list of row objects.")
    try:
      return cls.from_rows(obj.pop("rows"), **obj)
    except TypeError as e:
      raise ProfileError(f"GradientProfile.from_json: {e}") from e


def _row_kwargs(r: Mapping[str, Any]) -> dict[str, Any]:
  names = {f.name for f in dataclasses.fields(ProfileRow)}
  unknown = sorted(set(r) - names)
  if unknown:
    raise ProfileError(f"profile row {r.get('path', '?')!r}: unknown field(s) {unknown}.")
  missing = sorted({"path", "layer", "shape", "dtype", "nbytes", "ready_s"} - set(r))
  if missing:
    raise ProfileError(f"profile row {r.get('path', '?')!r}: missing field(s) {missing}.")
  return dict(r)


# --------------------------------------------------------------------------------------------------
# NetworkModel

# name: (alpha_s per ring step, beta_s_per_byte). Alpha is the per-message start-up of one ring step
# (software + NIC + switch); beta the inverse of the per-link bandwidth.
PRESETS: dict[str, tuple[float, float]] = {
    "1gbe": (50e-6, 1 / 125e6),
    "10gbe": (25e-6, 1 / 1.25e9),
    "25gbe": (10e-6, 1 / 3.125e9),
    "100gb-ib": (3e-6, 1 / 12.5e9),
    "nvlink": (2e-6, 1 / 150e9),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Pressure:
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
      if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) or \
          not math.isfinite(v) or v < 0:
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
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
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
    obj = _fields(cls, _loads(text_or_obj, "Pressure"), "Pressure")
    return cls(**obj)

  def to_json(self, indent: int | None = None) -> str:
    return json.dumps(self.to_dict(), indent=indent)


@dataclass(frozen=True, slots=True, kw_only=True)
class NetworkModel:
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

  def __post_init__(self):
    for n in ("alpha_s", "beta_s_per_byte", "skew"):
      v = getattr(self, n)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise NetworkError(f"NetworkModel has {n}={v!r}; it must be a finite number >= 0.")
      object.__setattr__(self, n, float(v))
    for n in ("workers", "links"):
      v = getattr(self, n)
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise NetworkError(f"NetworkModel has {n}={v!r}; it must be an integer >= 1.")
      object.__setattr__(self, n, int(v))
    if self.algorithm not in ALGORITHMS:
      raise NetworkError(f"NetworkModel has algorithm={self.algorithm!r}; expected one of {ALGORITHMS}.")
    object.__setattr__(self, "overlap", bool(self.overlap))
    if self.pressure is not None and not isinstance(self.pressure, Pressure):
      raise NetworkError(f"NetworkModel has pressure={self.pressure!r}; it must be a Pressure or None "
                         f"(e.g. Pressure(background_flows=0.3, tail_prob=0.01, tail_scale_s=0.002)).")

  @property
  def startup_s(self) -> float:
    """MG-WFBP's `a`: the fixed cost of one all-reduce, 2(P-1)·alpha_s."""
    return 2 * (self.workers - 1) * self.alpha_s

  @property
  def per_byte_s(self) -> float:
    """MG-WFBP's `b`: seconds per byte of one all-reduce, 2(P-1)/P·beta."""
    return 2 * (self.workers - 1) / self.workers * self.beta_s_per_byte

  def allreduce_s(self, nbytes: float) -> float:
    """Ring all-reduce time of `nbytes`: 2(P-1)·alpha_s + 2(P-1)/P·nbytes·beta (0 for one worker)."""
    return self.startup_s + self.per_byte_s * nbytes

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
    """A named interconnect: one of `PRESETS` ('1gbe', '10gbe', '25gbe', '100gb-ib', 'nvlink')."""
    if name not in PRESETS:
      raise NetworkError(f"unknown network preset {name!r}; expected one of {sorted(PRESETS)}, or a "
                         f"NetworkModel JSON file.")
    alpha, beta = PRESETS[name]
    return cls(alpha_s=alpha, beta_s_per_byte=beta, workers=workers, overlap=overlap, links=links,
               name=name)

  @classmethod
  def fit(cls, sizes: Sequence[float], seconds: Sequence[float], *, workers: int,
          overlap: bool = True, name: str = "fit", skew: float = 0.0) -> NetworkModel:
    """Least-squares alpha and beta from measured (bytes, seconds) of single all-reduces.

    `skew` (measured apart, see the class) is carried into the model unchanged.

    Fits seconds = a + b·bytes (a, b >= 0) in relative error, then alpha_s = a / (2(P-1)), beta = b·P / (2(P-1)).
    The RMS residual is kept in `fit_residual_s`.

    Raises:
      NetworkError: fewer than 2 distinct sizes, mismatched lengths, non-finite data, workers < 2.
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
    if isinstance(workers, bool) or int(workers) < 2:
      raise NetworkError(f"NetworkModel.fit(workers={workers!r}): a fit needs at least 2 workers.")
    a, b = nonneg_line(x, y)
    resid = float(np.sqrt(np.mean((a + b * x - y) ** 2)))
    p = int(workers)
    return cls(alpha_s=a / (2 * (p - 1)), beta_s_per_byte=b * p / (2 * (p - 1)), workers=p,
               overlap=overlap, name=name, fit_residual_s=resid, skew=skew)

  def to_dict(self) -> dict[str, Any]:
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    if self.pressure is None:
      del d["pressure"]      # a calm network's file is what it was before pressure existed
    else:
      d["pressure"] = self.pressure.to_dict()
    return d

  def to_json(self, indent: int | None = None) -> str:
    return json.dumps(self.to_dict(), indent=indent)

  @classmethod
  def from_json(cls, text_or_obj: str | Mapping[str, Any]) -> NetworkModel:
    obj = _fields(cls, _loads(text_or_obj, "NetworkModel"), "NetworkModel")
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


# --------------------------------------------------------------------------------------------------
# Argument checks shared by plan, the schedulers, simulate, lower_bound, the Monitor and the rewrite

_UNSET: Any = object()

# argument -> (what it must be, how to make one)
_KINDS = {
    "schedule": ("prophet_jax.Schedule",
                 "Make one with prophet_jax.plan(profile, network, policy) or Schedule.from_json."),
    "profile": ("prophet_jax.GradientProfile",
                "Make one with prophet_jax.profile_step(...), GradientProfile.from_params(params) or "
                "GradientProfile.from_json."),
    "network": ("prophet_jax.NetworkModel",
                "Make one with prophet_jax.measure_network(...), NetworkModel.preset(name, workers=...) "
                "or NetworkModel.from_json."),
}


def check_values(where: str, *, loss_fn: Any = _UNSET, tx: Any = _UNSET, schedule: Any = _UNSET,
                 profile: Any = _UNSET, network: Any = _UNSET, cross_step: Any = _UNSET,
                 axis_name: Any = _UNSET) -> None:
  """Raises TypeError naming `where` and the argument when one of those given has the wrong type.

  The one argument check of the library: the planners and the simulator (profile, network, schedule,
  cross_step) and the rewrite (`scheduled`, `hooked`, `pipelined`, `audit`: loss_fn, tx, schedule,
  axis_name) call it, so one argument is always checked, and named, the same way.

  Args:
    where: the caller, as the message should name it ('simulate()', 'wfbp scheduler', 'scheduled', ...).
    loss_fn: must be callable.
    tx: must be an optax GradientTransformation (anything with `init` and `update`).
    schedule, profile, network: must be a Schedule, a GradientProfile, a NetworkModel.
    cross_step: must be True or False (a step mode; 'auto' is resolved by plan() for policy 'auto').
    axis_name: must be a non-empty string, or a non-empty tuple of them (a pmap/shard_map axis).
  """
  from ._schedule import Schedule

  if loss_fn is not _UNSET and not callable(loss_fn):
    raise TypeError(f"{where}: `loss_fn` must be callable, loss_fn(params, batch) -> loss, got "
                    f"{type(loss_fn).__name__}.")
  if tx is not _UNSET and not (hasattr(tx, "init") and hasattr(tx, "update")):
    raise TypeError(f"{where}: `tx` must be an optax.GradientTransformation (with init and update), got "
                    f"{type(tx).__name__}. Pass e.g. optax.sgd(0.1, momentum=0.9).")
  for name, value, cls in (("schedule", schedule, Schedule), ("profile", profile, GradientProfile),
                           ("network", network, NetworkModel)):
    if value is not _UNSET and not isinstance(value, cls):
      what, fix = _KINDS[name]
      raise TypeError(f"{where}: `{name}` must be a {what}, got {type(value).__name__}. {fix}")
  if cross_step is not _UNSET and not isinstance(cross_step, (bool, np.bool_)):
    raise TypeError(f"{where}: cross_step={cross_step!r} must be True or False (the step mode); "
                    f"cross_step='auto' is a planning option of policy 'auto' only, through plan().")
  if axis_name is not _UNSET:
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not names or not all(isinstance(n, str) and n for n in names):
      raise TypeError(f"{where}: `axis_name` must be a non-empty string (or a tuple of them) naming the "
                      f"pmap/shard_map axis, got {axis_name!r}.")


def check_max_defer(where: str, max_defer: Any) -> float:
  """`max_defer` (the fraction of gradient elements a step may defer) as a float in [0, 1).

  Raises:
    ValueError: not a number in [0, 1); the message names `where` and the value.
  """
  if isinstance(max_defer, bool) or not isinstance(max_defer, (int, float, np.floating, np.integer)) or \
      not 0 <= max_defer < 1:
    raise ValueError(f"{where}: max_defer={max_defer!r} must be a fraction of the gradient elements in "
                     f"[0, 1), e.g. 0.1 (0: lossless, every element sent every step).")
  return float(max_defer)
