"""Chunk, Bucket and Schedule, checked on construction, and their JSON (pure numpy; docs/design.md,
"Values").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._errors import ScheduleError
from ._tree import is_float_dtype, rows_info
from ._schedule_checks import check_coverage, check_gathers, check_links
from ._sharding import FsdpPlan, check_fsdp, fsdp_fingerprint
from ._types import JsonValue, check_items, is_bool, is_int, nonneg_or_none, is_number, itemsize

SCHEDULE_SCHEMA = 1
FAMILIES = ("allreduce", "zero1", "fsdp")   # Schedule.family: what the plan's collectives do


def shard_size(size: int, workers: int) -> int:
  """Elements of one device's shard of a reduce-scatter of `size` elements among `workers`:
  ceil(size / workers), the buffer zero-padded to a multiple of `workers`.
  """
  return -(-int(size) // max(int(workers), 1))


@dataclass(frozen=True, slots=True, kw_only=True)
class Chunk:
  """Exactly one all-reduce: element slices (row, start, stop) of rows of one dtype, in buffer order."""

  slices: tuple[tuple[int, int, int], ...]
  dtype: str

  def __post_init__(self):
    if not isinstance(self.dtype, str) or not is_float_dtype(self.dtype):
      raise ScheduleError(f"a chunk has dtype={self.dtype!r}; chunks carry floating gradients only (e.g. "
                          f"'float32', 'bfloat16'): integer and float0 leaves are not all-reduced.")
    try:
      slices = tuple(tuple(x) for x in self.slices)
    except TypeError:
      raise ScheduleError(f"a {self.dtype} chunk has slices={self.slices!r}; slices are (row, start, "
                          f"stop) triples of integers.") from None
    bad = next((x for x in slices if len(x) != 3 or not all(map(is_int, x))), None)
    if bad is not None:
      raise ScheduleError(f"a {self.dtype} chunk has slice {bad!r}; a slice is (row, start, stop), three "
                          f"integers.")
    object.__setattr__(self, "slices", tuple((int(r), int(a), int(b)) for r, a, b in slices))
    if not self.slices:
      raise ScheduleError(f"a {self.dtype} chunk has no slices; every chunk must send at least one "
                          f"element. Drop the chunk, or give it the (row, start, stop) slices it sends.")
    for i, (r, a, b) in enumerate(self.slices):
      if r < 0 or a < 0 or b <= a:
        shown = self.slices[:4]
        raise ScheduleError(
            f"the {self.dtype} chunk with slices {shown}{' ...' if len(self.slices) > 4 else ''} has "
            f"slice {i} (row={r}, start={a}, stop={b}), which is {'empty' if b == a else 'negative'}: "
            f"a slice needs row >= 0 and 0 <= start < stop. Drop an empty slice (a zero-size leaf is "
            f"in no chunk), or plan again.")

  @property
  def size(self) -> int:
    return sum(b - a for _, a, b in self.slices)

  @property
  def nbytes(self) -> int:
    return self.size * itemsize(self.dtype)

  @property
  def rows(self) -> tuple[int, ...]:
    return tuple(dict.fromkeys(r for r, _, _ in self.slices))


@dataclass(frozen=True, slots=True, kw_only=True)
class Bucket:
  """A group of chunks planned together; issue order is tuple order.

  With `defer=k > 0` it is a deferral group (`dlcp`): m chunks of one dtype, m - k all-reduced each step
  (docs/design.md, "Values" and "Deferral in the rewrite (DLCP)").

  Attributes:
    chunks: the chunks (issue order; a deferral group's chunk index order).
    defer: k, chunks not all-reduced each step (0 <= 2k <= m).
    release: r in (0, 1], the fraction of a chunk's residual each send carries (1 without deferral).

  Raises:
    ScheduleError: no chunks, a bad `defer` or `release`, or a deferral group mixing dtypes.
  """

  chunks: tuple[Chunk, ...]
  defer: int = 0
  release: float = 1.0

  def __post_init__(self):
    object.__setattr__(self, "chunks", tuple(self.chunks))
    check_items(self.chunks, Chunk, ScheduleError, "a bucket has no chunks.", "a bucket has a chunk",
                "chunks are prophet_jax.Chunk values.")
    k, m = self.defer, len(self.chunks)
    if not is_int(k):
      raise ScheduleError(f"a bucket of {m} chunks has defer={k!r}; `defer` must be an integer number of "
                          f"chunks (0 for a lossless bucket).")
    k = int(k)
    object.__setattr__(self, "defer", k)
    if k < 0 or 2 * k > m:
      raise ScheduleError(f"a bucket of {m} chunks has defer={k}; a deferral group defers 0 <= defer <= "
                          f"{m // 2} of its {m} chunks (at most half, so a chunk deferred at one step "
                          f"can be sent at the next). Split the group into more chunks or defer fewer.")
    r = self.release
    if is_bool(r) or not is_number(r) or not 0 < float(r) <= 1:
      raise ScheduleError(f"a bucket of {m} chunks (defer={k}) has release={r!r}; `release` is the fraction "
                          f"of a deferred chunk's residual each send carries, a number in (0, 1] (1: all "
                          f"of it, at the next step).")
    # a lossless bucket has no residual: its release means nothing, stored as 1 (equal buckets compare
    # equal, and `dataclasses.replace(group, defer=0)` is the lossless bucket)
    object.__setattr__(self, "release", float(r) if k else 1.0)
    if k and len({c.dtype for c in self.chunks}) > 1:
      raise ScheduleError(f"a deferral group (defer={k}) mixes dtypes "
                          f"{sorted({c.dtype for c in self.chunks})}; its chunks share one slot shape, so "
                          f"they must share one dtype. Make one group per dtype.")

  @property
  def slots(self) -> int:
    """All-reduces the bucket issues per step: len(chunks) - defer."""
    return len(self.chunks) - self.defer

  @property
  def slot_size(self) -> int:
    """Elements per slot of a deferral group: its largest chunk's size (smaller chunks are padded)."""
    return max(c.size for c in self.chunks)

  @property
  def deferred_size(self) -> int:
    """The most elements the bucket defers in one step: its `defer` largest chunks' sizes (0 if k=0)."""
    return sum(sorted((c.size for c in self.chunks), reverse=True)[:self.defer])

  def allreduce_sizes(self) -> tuple[int, ...]:
    """Elements of each all-reduce the bucket issues per step, in issue order: each chunk's size, or
    `slots` times `slot_size` for a deferral group."""
    return (self.slot_size,) * self.slots if self.defer else tuple(c.size for c in self.chunks)


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule(JsonValue):
  """An ordered plan of collectives for one gradient tree (docs/design.md, "Values").

  Attributes:
    buckets: issue order is tuple order (buckets, then their chunks).
    rows: (path, shape, dtype) of every profile row; the rewrite maps rows to leaves by path.
    tree_fingerprint: hash of `rows` (and an FSDP plan's placement); checked on construction.
    policy, options: the policy that planned it and its options, as sorted (name, value) pairs.
    cross_step: the step mode planned for (False: plain step; True: pipelined step).
    predicted_s: the simulated iteration at planning, seconds, or None.
    links: the link of every issued all-reduce, in issue order; empty: one link.
    gathers: a sharded (ZeRO-1) schedule's all-gathers, each the chunk indices it gathers; else empty.
    fsdp: None, or the FSDP plan (`FsdpPlan`).
    family: 'allreduce', 'zero1' or 'fsdp' (derived from `gathers` and `fsdp` when not given).
    schema: format version.

  Raises:
    ScheduleError: a broken invariant, naming the chunk, gather or leaf.
  """

  buckets: tuple[Bucket, ...]
  rows: tuple[tuple[str, tuple[int, ...], str], ...]
  tree_fingerprint: str = ""
  policy: str = "custom"
  options: tuple[tuple[str, Any], ...] = ()
  cross_step: bool = False
  predicted_s: float | None = None
  links: tuple[int, ...] = ()
  gathers: tuple[tuple[int, ...], ...] = ()
  fsdp: FsdpPlan | None = None
  family: str = ""
  schema: int = SCHEDULE_SCHEMA

  def __post_init__(self):
    object.__setattr__(self, "buckets", tuple(self.buckets))
    check_items(self.buckets, Bucket, ScheduleError, None, "a schedule has a bucket",
                "buckets are prophet_jax.Bucket values.")
    check_links(self)
    check_gathers(self)
    try:
      info = rows_info(self.rows)
    except (TypeError, ValueError) as e:
      raise ScheduleError(f"schedule rows: {e} Plan again (prophet_jax.plan) for the current profile.") from None
    object.__setattr__(self, "rows", info.rows)
    if not isinstance(self.policy, str) or not self.policy:
      raise ScheduleError(f"schedule has policy={self.policy!r}; it must be a non-empty string naming the "
                          f"policy that planned it.")
    if not isinstance(self.options, (Mapping, tuple, list)):
      raise ScheduleError(f"schedule has options={self.options!r}; expected the policy's options as an "
                          f"object of name: value.")
    object.__setattr__(self, "options", tuple(sorted((str(k), _freeze(v)) for k, v in dict(self.options).items())))
    if not is_bool(self.cross_step):
      raise ScheduleError(f"schedule has cross_step={self.cross_step!r}; it must be True or False (JSON true "
                          f"or false): the step mode it was planned for.")
    object.__setattr__(self, "cross_step", bool(self.cross_step))
    object.__setattr__(self, "predicted_s", nonneg_or_none(self.predicted_s, lambda p: ScheduleError(
        f"schedule has predicted_s={p!r}; it must be a finite number of seconds >= 0 (the simulator's "
        f"iteration at planning) or null.")))
    if self.schema != SCHEDULE_SCHEMA:
      raise ScheduleError(f"schedule has schema={self.schema!r}; this version reads {SCHEDULE_SCHEMA}.")
    fp = fsdp_fingerprint(info.fingerprint, self.fsdp)
    if not self.tree_fingerprint:
      object.__setattr__(self, "tree_fingerprint", fp)
    elif self.tree_fingerprint != fp:
      raise ScheduleError(f"schedule's tree_fingerprint {self.tree_fingerprint!r} does not match its rows "
                          f"(which hash to {fp!r}): the file was edited. Plan again.")
    check_coverage(self, info)
    check_fsdp(self)
    family = "fsdp" if self.fsdp is not None else "zero1" if self.gathers else "allreduce"
    if self.family not in ("", family):
      raise ScheduleError(f"schedule has family={self.family!r}, but its collectives are those of "
                          f"{family!r} (families: {', '.join(FAMILIES)}): the file was edited. Plan again.")
    object.__setattr__(self, "family", family)

  @property
  def chunks(self) -> tuple[Chunk, ...]:
    """Every chunk in issue order."""
    return tuple(c for b in self.buckets for c in b.chunks)

  @property
  def num_allreduces(self) -> int:
    """All-reduces issued per step: one per chunk, a deferral group's `slots` (m - k); for a sharded
    schedule the reduce-scatters.
    """
    return sum(b.slots for b in self.buckets)

  @property
  def placement(self) -> tuple[int | None, ...]:
    """Per row, the dimension its parameter is split on over the data axes (an FSDP plan's sharded
    leaves), or None: replicated."""
    return self.fsdp.shard_dims if self.fsdp is not None else (None,) * len(self.rows)

  @property
  def sharded(self) -> bool:
    """True for a ZeRO-1 (`dear`) schedule: `family == 'zero1'` (read-only, derived)."""
    return self.family == "zero1"

  @property
  def num_reduce_scatters(self) -> int:
    """Reduce-scatters issued per step: one per chunk of a sharded schedule, else 0."""
    return len(self.chunks) if self.gathers else 0

  @property
  def num_all_gathers(self) -> int:
    """All-gathers issued per step: `len(gathers)` (0 for an all-reduce schedule)."""
    return len(self.gathers)

  def padded_sizes(self, workers: int) -> tuple[int, ...]:
    """Elements of every chunk's buffer zero-padded to a multiple of `workers`, in issue order."""
    workers = _check_workers("padded_sizes", workers)
    return tuple(workers * shard_size(c.size, workers) for c in self.chunks)

  def shard_nbytes(self, workers: int) -> int:
    """Bytes of one device's shards of every chunk: a ZeRO-1 step's per-device share of a per-parameter
    state of the gradients' dtype.
    """
    workers = _check_workers("shard_nbytes", workers)
    return sum(shard_size(c.size, workers) * itemsize(c.dtype) for c in self.chunks)

  def gather_sizes(self, workers: int) -> tuple[int, ...]:
    """Elements of every all-gather's result, in all-gather order (empty for an all-reduce schedule)."""
    workers = _check_workers("gather_sizes", workers)
    chunks = self.chunks
    return tuple(workers * sum(shard_size(chunks[k].size, workers) for k in g) for g in self.gathers)

  @property
  def defers(self) -> bool:
    """True when some bucket is a deferral group (the schedule is lossy per step, not overall)."""
    return any(b.defer for b in self.buckets)

  @property
  def max_deferred_fraction(self) -> float:
    """The most gradient elements deferred in one step, as a fraction of all elements (0 without deferral)."""
    total = sum(math.prod(shape) for _, shape, _ in self.rows)
    return sum(b.deferred_size for b in self.buckets if b.defer) / total if total else 0.0

  def chunk_nbytes(self) -> tuple[int, ...]:
    return tuple(c.nbytes for c in self.chunks)

  def allreduce_sizes(self) -> tuple[int, ...]:
    """Elements of every all-reduce issued per step, in issue order (a deferral group's padded slots): what
    `audit` expects.
    """
    return tuple(n for b in self.buckets for n in b.allreduce_sizes())

  def allreduce_nbytes(self) -> tuple[int, ...]:
    """Bytes of every all-reduce issued per step, in issue order (what `simulate` charges)."""
    return tuple(n * itemsize(c.dtype) for b in self.buckets
                 for n, c in zip(b.allreduce_sizes(), b.chunks))

  def describe(self, max_chunks: int = 12) -> str:
    """A short human summary: buckets, chunks, bytes and leading paths, and the planner's `decision`."""
    head = f"schedule {self.policy} ({'pipelined' if self.cross_step else 'plain'} step)"
    lines = [f"{head}: {len(self.buckets)} buckets, {self.num_allreduces} all-reduces"]
    if self.gathers:
      lines[0] = (f"{head}, sharded (ZeRO-1): {self.num_reduce_scatters} reduce-scatters in backward, "
                  f"{self.num_all_gathers} all-gathers for the next forward")
    f = self.fsdp
    if f is not None:
      n_g = len(f.gathers or f.units)
      lines[0] = (f"{head}, FSDP on {dict(f.mesh)} (shards over {', '.join(f.shard_axes)}): {n_g} all-gathers "
                  f"in forward (prefetch {f.prefetch}), {n_g - sum(f.keep)} again in backward, {len(f.units)} "
                  f"reduce-scatters, {len(self.chunks) - len(f.units)} all-reduces of replicated leaves")
      if f.micro_batches > 1:
        lines[0] += (f"; {f.micro_batches} micro-batches per step ({sum(f.hold_params)} groups gathered once and held, "
                     f"{sum(f.hold_grads)} units reduce-scattered once)")
    if self.defers:
      groups = [b for b in self.buckets if b.defer]
      lines[0] += (f"; {len(groups)} deferral groups defer {sum(b.defer for b in groups)} of "
                   f"{sum(len(b.chunks) for b in groups)} chunks per step (at most "
                   f"{self.max_deferred_fraction:.2%} of the elements, "
                   + ("one step late)" if all(b.release == 1 for b in groups) else
                      f"released {min(b.release for b in groups):g} per send)"))
    if self.links:
      lines[0] += f"; striped over {max(self.links) + 1} links"
    decision = dict(self.options).get("decision")
    if decision:
      lines.append(f"  decision: {decision}")
    for k, c in enumerate(self.chunks[:max_chunks]):
      paths = [self.rows[r][0] for r in c.rows]
      head = ", ".join(paths[:2]) + (f", +{len(paths) - 2}" if len(paths) > 2 else "")
      lines.append(f"  chunk{k}: {c.nbytes / 2**20:8.3f} MiB {c.dtype:9s} [{head}]")
    if self.num_allreduces > max_chunks:
      lines.append(f"  ... {self.num_allreduces - max_chunks} more")
    for g, ks in enumerate(self.gathers[:max_chunks]):
      head = ", ".join(f"chunk{k}" for k in ks[:4]) + (f", +{len(ks) - 4}" if len(ks) > 4 else "")
      lines.append(f"  gather{g}: {sum(self.chunks[k].nbytes for k in ks) / 2**20:8.3f} MiB [{head}]")
    if len(self.gathers) > max_chunks:
      lines.append(f"  ... {len(self.gathers) - max_chunks} more gathers")
    return "\n".join(lines)

  def to_dict(self) -> dict[str, Any]:
    return {
        "schema": self.schema, "family": self.family, "policy": self.policy, "options": dict(self.options),
        "cross_step": self.cross_step, "predicted_s": self.predicted_s,
        "tree_fingerprint": self.tree_fingerprint,
        "rows": [[p, list(s), t] for p, s, t in self.rows],
        "buckets": [_bucket_json(b) for b in self.buckets],
    } | ({"links": list(self.links)} if self.links else {}) | (
        {"gathers": [list(g) for g in self.gathers]} if self.gathers else {}) | (
        {"fsdp": self.fsdp.to_dict()} if self.fsdp is not None else {})

  @classmethod
  def from_json(cls, text_or_obj: str | Mapping[str, Any]) -> Schedule:
    obj = cls._json_fields(text_or_obj)
    missing = sorted({"buckets", "rows"} - set(obj))
    if missing:
      raise ScheduleError(f"Schedule.from_json: missing field(s) {missing}; a schedule file is what "
                          f"Schedule.to_json (or `prophet-jax plan --out`) writes.")
    for name in ("buckets", "rows"):
      if not isinstance(obj[name], list):
        raise ScheduleError(f"Schedule.from_json: '{name}' must be a list, got {obj[name]!r:.60}.")
    if not isinstance(obj.get("options", {}), Mapping):
      raise ScheduleError(f"Schedule.from_json: 'options' must be an object of name: value, got "
                          f"{obj['options']!r:.60}.")
    try:
      buckets = tuple(_bucket_from_json(b, i) for i, b in enumerate(obj.pop("buckets")))
      rows = tuple(_row_from_json(r, k) for k, r in enumerate(obj.pop("rows")))
      if "gathers" in obj:
        obj["gathers"] = tuple(tuple(g) for g in obj["gathers"])
      if obj.get("fsdp") is not None:
        obj["fsdp"] = FsdpPlan.from_dict(obj["fsdp"])
    except (KeyError, TypeError, ValueError) as e:
      if isinstance(e, ScheduleError):
        raise
      raise ScheduleError(f"Schedule.from_json: malformed 'buckets', 'rows' or 'gathers' ({e!r}).") from e
    return cls(buckets=buckets, rows=rows, **obj)


def _bucket_json(b: Bucket) -> Any:
  """A bucket as JSON: the list of its chunks, or for a deferral group {"defer", "chunks"[, "release"]}."""
  chunks = [{"dtype": c.dtype, "slices": [list(s) for s in c.slices]} for c in b.chunks]
  if not b.defer:
    return chunks
  return {"defer": b.defer, "chunks": chunks} | ({"release": b.release} if b.release != 1 else {})


def _row_from_json(r: Any, k: int) -> tuple[Any, Any, Any]:
  if not isinstance(r, list) or len(r) != 3:
    raise ScheduleError(f"Schedule.from_json: row {k} is {r!r:.60}; a row is [path, shape, dtype].")
  p, s, t = r
  if not isinstance(s, list):
    raise ScheduleError(f"Schedule.from_json: row {k} ({p!r}) has shape {s!r}; a shape is a list of "
                        f"integers.")
  return p, tuple(s), t


def _bucket_from_json(b: Any, i: int) -> Bucket:
  defer, release = 0, 1.0
  if isinstance(b, Mapping):
    unknown = sorted(set(b) - {"defer", "chunks", "release"})
    if unknown:
      raise ScheduleError(f"Schedule.from_json: a bucket has unknown field(s) {unknown}; expected "
                          f"'chunks', 'defer' and 'release'.")
    defer, release, b = b.get("defer", 0), b.get("release", 1.0), b["chunks"]
  if not isinstance(b, list):
    raise ScheduleError(f"Schedule.from_json: bucket {i} is {b!r:.60}; a bucket is a list of chunks (or "
                        f"an object with 'chunks' and 'defer').")
  chunks = []
  for j, c in enumerate(b):
    if not isinstance(c, Mapping) or set(c) != {"dtype", "slices"}:
      raise ScheduleError(f"Schedule.from_json: bucket {i}, chunk {j} is {c!r:.60}; a chunk is an object "
                          f"with 'dtype' and 'slices'.")
    try:
      chunks.append(Chunk(slices=tuple(tuple(s) for s in c["slices"]), dtype=c["dtype"]))
    except ScheduleError as e:
      raise ScheduleError(f"Schedule.from_json: bucket {i}, chunk {j}: {e}") from None
  return Bucket(chunks=tuple(chunks), defer=defer, release=release)


def _check_workers(call: str, workers: Any) -> int:
  """`workers` as an int >= 1 (numpy integers welcome), or a TypeError/ValueError naming it."""
  if not is_int(workers) or workers < 1:
    raise (ValueError if is_int(workers) else TypeError)(
        f"Schedule.{call}(workers={workers!r}): `workers` must be an integer >= 1, the number of devices "
        f"sharing the shards, e.g. network.workers.")
  return int(workers)


def _freeze(v: Any) -> Any:
  if isinstance(v, list | tuple):
    return tuple(_freeze(x) for x in v)
  if isinstance(v, dict):
    return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
  return v
