"""The Schedule: an ordered plan of all-reduces (Buckets of Chunks) for one gradient tree.

Pure: numpy only, never jax. A Schedule checks its invariant whenever it is built (`dataclasses.replace`
included): every element of every row with a nonzero size is in exactly one chunk, once, in a chunk of
the row's dtype (vectorised over the slices; memoized per row tuple, see `_tree.rows_info`); and its
`tree_fingerprint` is its rows'. It round-trips through JSON.
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

__all__ = ["Chunk", "Bucket", "Schedule", "SCHEDULE_SCHEMA", "FAMILIES", "shard_size"]

SCHEDULE_SCHEMA = 1
FAMILIES = ("allreduce", "zero1", "fsdp")   # Schedule.family: what the plan's collectives do


def shard_size(size: int, workers: int) -> int:
  """Elements of one device's shard of a reduce-scatter of `size` elements among `workers`: the buffer
  is zero-padded at its end to a multiple of `workers` (ceil(size / workers) each; 0 for 0)."""
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
  """A group of chunks planned together (e.g. one Prophet block); issue order is tuple order.

  With `defer=0` (every policy but `dlcp`) each chunk is one all-reduce, every step.

  With `defer=k > 0` the bucket is a *deferral group* (DLCP's bounded loss tolerance, in the honest
  software form): m = len(chunks) chunks of one dtype (the `dlcp` planner makes them the equal
  parts of one layer's rows of one dtype), of which only m - k are all-reduced each step. Run-time
  semantics, which the rewrite (`scheduled`, `hooked`, `pipelined`) implements and `simulate` times:

  * Slots. The step issues m - k all-reduces for the bucket, its *slots*, in slot order, each of
    `slot_size` elements (the bucket's largest chunk; a smaller chunk is zero-padded at its end),
    where the bucket's first chunk would be issued. A slot is ready when every chunk of the bucket
    is (the slot's chunk is chosen at run time, so each slot depends on all of them).
  * Which chunks. Slot s carries the chunk of rank s, ranked by `score` in decreasing order, ties
    by chunk index (a stable sort of -score): score[i] = +inf if chunk i was deferred in the
    previous step, else norm[i], the L2 norm of chunk i's *reduced* (all-reduced, averaged) values
    the last time it was sent, in float32 (a NaN norm counts as +inf). The chunks of the last k ranks
    are deferred this step. Every worker holds the reduced values bitwise identically (they are
    all-reduce results), and the ranking is the same computation on the same floats, so every
    worker sends and defers the same chunks, with no extra communication.
  * Never twice in a row. A chunk deferred at step t has score +inf at t + 1, so it is sent then
    (this needs 2k <= m, an invariant): with `release` 1, staleness is at most one step.
  * The first step. Before any step, norm = 0 and nothing was deferred: the ranking is by index, so
    the first step sends chunks 0..m-k-1 and defers the last k.
  * Error feedback, so nothing is lost. A deferred chunk contributes zero to this step's reduced
    gradient; each worker keeps its local values of it (the residual) and, with `release` 1, adds
    them to the same elements of its gradient at the next step, which sends them (never twice in a
    row). Summed over steps, every worker's every gradient value is all-reduced exactly once, at most
    one step late.
  * Damped feedback (`release` = r < 1). A send carries the chunk's gradient plus only r of its
    residual; the rest, (1 - r) of it, stays in the residual (now one row per chunk, m rows; float32
    for a narrower float, and a sent row keeps what it owed less what it sent, as cast), which a
    deferral adds the chunk's values to. A deferred value is then applied over the chunk's following
    sends, r, r(1 - r), r(1 - r)^2, ... of it: still nothing lost (what is not yet sent is in the
    residual: `prophet_jax.deferred_grads`), but the late part reaches the optimizer spread out and
    damped. Why: a gradient applied one step late inside a momentum optimizer feeds back with a
    delay, and a delayed loop is far less stable (heavy-ball with momentum 0.9 stays stable for a
    step size times curvature below 3.8 without delay and below 0.1 with one step of it); sending
    the late values back at once made the issue-27 CNN end 6.7% above the lossless run, worse than
    dropping them, and r = 0.05 (`dlcp`'s default) within 2% (bench/dlcp.py --part convergence).

  Attributes:
    chunks: the chunks (issue order without deferral; the deferral group's chunk index order).
    defer: k, the number of chunks not all-reduced each step (0 <= 2k <= m; k > 0 needs one dtype).
    release: r, the fraction of a chunk's residual each send carries (0 < r <= 1; 1, the default:
      all of it, one step late). Without deferral there is no residual: stored as 1.

  Raises:
    ScheduleError: no chunks; `defer` not an integer, negative, or more than half the chunks; a
      deferral group mixing dtypes; `release` not a number in (0, 1] (each message names the
      bucket's values).
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
    if not self.defer:
      return tuple(c.size for c in self.chunks)
    return (self.slot_size,) * self.slots


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule(JsonValue):
  """An ordered plan of all-reduces for one gradient tree.

  Attributes:
    buckets: issue order is tuple order (buckets, then their chunks).
    rows: (path, shape, dtype) of every profile row, so the rewrite maps rows to leaves by path.
    tree_fingerprint: hash of `rows`; checked on construction and against the tree at trace time.
    policy: the policy that planned it ('wfbp', 'bucket', 'mgwfbp', 'prophet', 'auto', ...).
    options: the policy's options, as sorted (name, value) pairs.
    cross_step: the step mode it was planned for (False: plain step; True: pipelined step).
    predicted_s: the simulator's iteration time at planning (None if not predicted).
    links: the link (tie chain) of every issued all-reduce, in issue order (`num_allreduces` of
      them); empty: one link. `plan` records the links its calm simulation assigned (earliest free
      link, in issue order) when `network.links > 1`; the rewrite keeps one tie chain per link, so up
      to that many all-reduces may be in flight.
    gathers: empty for an all-reduce schedule. Non-empty for a *sharded* schedule (the `dear` policy,
      ZeRO-1): each chunk is then one **reduce-scatter** of its flat buffer (its slices gathered in
      order, zero-padded at the end to a multiple of the axis size, `shard_size`), issued in chunk
      order in backward, after which each device holds and updates 1/n of the chunk; each entry of
      `gathers` is one **all-gather**, listing the indices (into `chunks`, issue order) of the
      reduce-scatter chunks whose (updated) shards it gathers, in all-gather issue order (front layers
      first, for the next forward). Every chunk index is in exactly one gather, and a gather holds
      chunks of one dtype. A sharded schedule has no deferral groups and one link.
    fsdp: None, or the FSDP (ZeRO-3) plan (`_sharding.FsdpPlan`; the `fsdp` policy): which chunks are
      reduce-scattered FSDP buckets (the rest replicated leaves' all-reduces), their forward all-gather
      order and prefetch, what backward gathers again, and the rows' placement (in the fingerprint).
    family: the plan's family, the one field every choice between families reads: 'allreduce'
      (all-reduces; gradients and optimizer state replicated), 'zero1' (a sharded schedule: `gathers`
      non-empty) or 'fsdp' (`fsdp` set). Derived from `gathers` and `fsdp` when not given (files
      written before the field existed); a given family must agree with them.
    schema: format version.

  Invariant (checked on construction): every element of every row with a nonzero size is in exactly one
  chunk, once; every chunk holds rows of its own dtype. A deferral group (`Bucket.defer > 0`) holds
  its elements in its chunks like any bucket: coverage is unchanged; at run time up to `defer` of its
  chunks wait each step (error feedback, nothing lost; see `Bucket`). A sharded schedule's `gathers`
  partition its chunk indices, one dtype per gather (errors name the gather).
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
    """All-reduces issued per step: one per chunk, but a deferral group's `slots` (m - k). For a
    sharded schedule, the chunk messages are reduce-scatters: this counts them (`num_reduce_scatters`)."""
    return sum(b.slots for b in self.buckets)

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
    """Elements of every chunk's buffer once zero-padded to a multiple of `workers` (what a sharded
    schedule's reduce-scatter sends; `workers` x `shard_size`), in issue order."""
    workers = _check_workers("padded_sizes", workers)
    return tuple(workers * shard_size(c.size, workers) for c in self.chunks)

  def shard_nbytes(self, workers: int) -> int:
    """Bytes of one device's shards of every chunk (each chunk's buffer padded on its own,
    `shard_size` elements of its dtype): what a sharded (ZeRO-1) step keeps per device of a
    per-parameter optimizer state of the gradients' dtype, against `sum(chunk.nbytes)` replicated."""
    workers = _check_workers("shard_nbytes", workers)
    return sum(shard_size(c.size, workers) * itemsize(c.dtype) for c in self.chunks)

  def gather_sizes(self, workers: int) -> tuple[int, ...]:
    """Elements of every all-gather's result, in all-gather order: `workers` x the sum of its chunks'
    shards (each chunk padded on its own). Empty for an all-reduce schedule."""
    workers = _check_workers("gather_sizes", workers)
    chunks = self.chunks
    return tuple(workers * sum(shard_size(chunks[k].size, workers) for k in g) for g in self.gathers)

  @property
  def defers(self) -> bool:
    """True when some bucket is a deferral group (the schedule is lossy per step, not overall)."""
    return any(b.defer for b in self.buckets)

  @property
  def max_deferred_fraction(self) -> float:
    """The most gradient elements deferred in one step, as a fraction of all elements (each group's
    `defer` largest chunks: with equal chunks, what it defers every step). 0 without deferral."""
    total = sum(math.prod(shape) for _, shape, _ in self.rows)
    deferred = sum(b.deferred_size for b in self.buckets if b.defer)
    return deferred / total if total else 0.0

  def chunk_nbytes(self) -> tuple[int, ...]:
    return tuple(c.nbytes for c in self.chunks)

  def allreduce_sizes(self) -> tuple[int, ...]:
    """Elements of every all-reduce issued per step, in issue order (a deferral group's padded slots
    once each): what `audit` should find in the compiled step, `num_allreduces` of them."""
    return tuple(n for b in self.buckets for n in b.allreduce_sizes())

  def allreduce_nbytes(self) -> tuple[int, ...]:
    """Bytes of every all-reduce issued per step, in issue order (what `simulate` charges)."""
    return tuple(n * itemsize(c.dtype) for b in self.buckets
                 for n, c in zip(b.allreduce_sizes(), b.chunks))

  def describe(self, max_chunks: int = 12) -> str:
    """A short human summary: buckets, chunks, bytes and leading paths, in issue order; and the
    planner's `decision` option where it recorded one (`dlcp`: how much it defers, or why not)."""
    lines = [f"schedule {self.policy} ({'pipelined' if self.cross_step else 'plain'} step): "
             f"{len(self.buckets)} buckets, {self.num_allreduces} all-reduces"]
    if self.gathers:
      lines[0] = (f"schedule {self.policy} ({'pipelined' if self.cross_step else 'plain'} step), sharded "
                  f"(ZeRO-1): {self.num_reduce_scatters} reduce-scatters in backward, "
                  f"{self.num_all_gathers} all-gathers for the next forward")
    f = self.fsdp
    if f is not None:
      n_g = len(f.gathers or f.units)
      lines[0] = (f"schedule {self.policy} ({'pipelined' if self.cross_step else 'plain'} step), FSDP on "
                  f"{dict(f.mesh)} (shards over {', '.join(f.shard_axes)}): {n_g} all-gathers in forward "
                  f"(prefetch {f.prefetch}), {n_g - sum(f.keep)} again in backward, {len(f.units)} "
                  f"reduce-scatters, {len(self.chunks) - len(f.units)} all-reduces of replicated leaves")
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
  """A bucket as JSON: the list of its chunks (as every schedule file since schema 1 has it), or, for
  a deferral group, {"defer": k, "chunks": [...]} with "release": r when r < 1 (so files without
  deferral, or with r = 1, are unchanged)."""
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
  if not is_int(workers):
    raise TypeError(f"Schedule.{call}(workers={workers!r}): `workers` must be an integer >= 1, the "
                    f"number of devices sharing the shards, e.g. network.workers.")
  if workers < 1:
    raise ValueError(f"Schedule.{call}(workers={workers!r}): `workers` must be an integer >= 1, the "
                     f"number of devices sharing the shards, e.g. network.workers.")
  return int(workers)


def _freeze(v: Any) -> Any:
  if isinstance(v, list | tuple):
    return tuple(_freeze(x) for x in v)
  if isinstance(v, dict):
    return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
  return v
