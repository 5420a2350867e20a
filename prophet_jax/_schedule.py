"""The Schedule: an ordered plan of all-reduces (Buckets of Chunks) for one gradient tree.

Pure: numpy only, never jax. A Schedule checks its invariant whenever it is built (`dataclasses.replace`
included): every element of every row with a nonzero size is in exactly one chunk, once, in a chunk of
the row's dtype (vectorised over the slices; memoized per row tuple, see `_tree.rows_info`); and its
`tree_fingerprint` is its rows'. It round-trips through JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._errors import ScheduleError
from ._tree import RowsInfo, rows_info
from ._types import _fields, _loads, itemsize

__all__ = ["Chunk", "Bucket", "Schedule", "SCHEDULE_SCHEMA"]

SCHEDULE_SCHEMA = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Chunk:
  """Exactly one all-reduce: element slices (row, start, stop) of rows of one dtype, in buffer order."""

  slices: tuple[tuple[int, int, int], ...]
  dtype: str

  def __post_init__(self):
    object.__setattr__(self, "slices", tuple((int(r), int(a), int(b)) for r, a, b in self.slices))
    if not self.slices:
      raise ScheduleError("a chunk has no slices; every chunk must send at least one element.")
    for r, a, b in self.slices:
      if r < 0 or a < 0 or b <= a:
        raise ScheduleError(f"chunk slice (row={r}, start={a}, stop={b}) is empty or negative; need "
                            f"0 <= start < stop.")

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
  """A group of chunks planned together (e.g. one Prophet block); issue order is tuple order."""

  chunks: tuple[Chunk, ...]

  def __post_init__(self):
    object.__setattr__(self, "chunks", tuple(self.chunks))
    if not self.chunks:
      raise ScheduleError("a bucket has no chunks.")


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
  """An ordered plan of all-reduces for one gradient tree.

  Attributes:
    buckets: issue order is tuple order (buckets, then their chunks).
    rows: (path, shape, dtype) of every profile row, so the rewrite maps rows to leaves by path.
    tree_fingerprint: hash of `rows`; checked on construction and against the tree at trace time.
    policy: the policy that planned it ('wfbp', 'bucket', 'mgwfbp', 'prophet', 'auto', ...).
    options: the policy's options, as sorted (name, value) pairs.
    cross_step: the step mode it was planned for (False: plain step; True: pipelined step).
    predicted_s: the simulator's iteration time at planning (None if not predicted).
    schema: format version.

  Invariant (checked on construction): every element of every row with a nonzero size is in exactly one
  chunk, once; every chunk holds rows of its own dtype.
  """

  buckets: tuple[Bucket, ...]
  rows: tuple[tuple[str, tuple[int, ...], str], ...]
  tree_fingerprint: str = ""
  policy: str = "custom"
  options: tuple[tuple[str, Any], ...] = ()
  cross_step: bool = False
  predicted_s: float | None = None
  schema: int = SCHEDULE_SCHEMA

  def __post_init__(self):
    object.__setattr__(self, "buckets", tuple(self.buckets))
    info = rows_info(self.rows)
    object.__setattr__(self, "rows", info.rows)
    object.__setattr__(self, "options", tuple(sorted((str(k), _freeze(v)) for k, v in dict(self.options).items())))
    object.__setattr__(self, "cross_step", bool(self.cross_step))
    if self.schema != SCHEDULE_SCHEMA:
      raise ScheduleError(f"schedule has schema={self.schema!r}; this version reads {SCHEDULE_SCHEMA}.")
    fp = info.fingerprint
    if not self.tree_fingerprint:
      object.__setattr__(self, "tree_fingerprint", fp)
    elif self.tree_fingerprint != fp:
      raise ScheduleError(f"schedule's tree_fingerprint {self.tree_fingerprint!r} does not match its rows "
                          f"(which hash to {fp!r}): the file was edited. Plan again.")
    _check_coverage(self, info)

  @property
  def chunks(self) -> tuple[Chunk, ...]:
    """Every chunk in issue order."""
    return tuple(c for b in self.buckets for c in b.chunks)

  @property
  def num_allreduces(self) -> int:
    return sum(len(b.chunks) for b in self.buckets)

  def chunk_nbytes(self) -> tuple[int, ...]:
    return tuple(c.nbytes for c in self.chunks)

  def describe(self, max_chunks: int = 12) -> str:
    """A short human summary: buckets, chunks, bytes and leading paths, in issue order."""
    lines = [f"schedule {self.policy} ({'pipelined' if self.cross_step else 'plain'} step): "
             f"{len(self.buckets)} buckets, {self.num_allreduces} all-reduces"]
    for k, c in enumerate(self.chunks[:max_chunks]):
      paths = [self.rows[r][0] for r in c.rows]
      head = ", ".join(paths[:2]) + (f", +{len(paths) - 2}" if len(paths) > 2 else "")
      lines.append(f"  chunk{k}: {c.nbytes / 2**20:8.3f} MiB {c.dtype:9s} [{head}]")
    if self.num_allreduces > max_chunks:
      lines.append(f"  ... {self.num_allreduces - max_chunks} more")
    return "\n".join(lines)

  def to_dict(self) -> dict[str, Any]:
    return {
        "schema": self.schema, "policy": self.policy, "options": dict(self.options),
        "cross_step": self.cross_step, "predicted_s": self.predicted_s,
        "tree_fingerprint": self.tree_fingerprint,
        "rows": [[p, list(s), t] for p, s, t in self.rows],
        "buckets": [[{"dtype": c.dtype, "slices": [list(s) for s in c.slices]} for c in b.chunks]
                    for b in self.buckets],
    }

  def to_json(self, indent: int | None = None) -> str:
    return json.dumps(self.to_dict(), indent=indent)

  @classmethod
  def from_json(cls, text_or_obj: str | Mapping[str, Any]) -> Schedule:
    obj = _fields(cls, _loads(text_or_obj, "Schedule"), "Schedule")
    try:
      buckets = tuple(Bucket(chunks=tuple(Chunk(slices=tuple(tuple(s) for s in c["slices"]), dtype=c["dtype"])
                                          for c in b)) for b in obj.pop("buckets"))
      rows = tuple((p, tuple(s), t) for p, s, t in obj.pop("rows"))
    except (KeyError, TypeError, ValueError) as e:
      if isinstance(e, ScheduleError):
        raise
      raise ScheduleError(f"Schedule.from_json: malformed 'buckets' or 'rows' ({e!r}).") from e
    return cls(buckets=buckets, rows=rows, **obj)


def _freeze(v: Any) -> Any:
  if isinstance(v, list | tuple):
    return tuple(_freeze(x) for x in v)
  if isinstance(v, dict):
    return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
  return v


def _check_coverage(s: Schedule, info: RowsInfo) -> None:
  """Every element of every row in exactly one chunk, once, in a chunk of the row's dtype.

  Vectorised over the slices; on a violation, `_coverage_error` walks them to name it.
  """
  chunks = s.chunks
  sizes = info.sizes
  counts = [len(c.slices) for c in chunks]
  flat = np.array([x for c in chunks for x in c.slices], dtype=np.int64).reshape(-1, 3)
  r, a, b = flat[:, 0], flat[:, 1], flat[:, 2]
  ok = bool((r < len(sizes)).all())
  if ok and r.size:
    chunk_code = np.array([info.dtypes.get(c.dtype, -1) for c in chunks], dtype=np.int64)
    ok = bool((info.dtype_code[r] == np.repeat(chunk_code, counts)).all() and (b <= sizes[r]).all())
  if ok:
    order = np.lexsort((a, r))
    r, a, b = r[order], a[order], b[order]
    first = np.r_[True, r[1:] != r[:-1]] if r.size else np.zeros(0, dtype=bool)
    expected = np.where(first, 0, np.r_[0, b[:-1]])        # a row's slices start where the last ended
    last = np.r_[first[1:], True] if r.size else first
    ok = bool((a == expected).all() and (b[last] == sizes[r[last]]).all()
              and np.count_nonzero(first) == np.count_nonzero(sizes))
  if not ok:
    _coverage_error(s)


def _coverage_error(s: Schedule) -> None:
  """Raises the ScheduleError that names the first chunk or leaf breaking coverage."""
  sizes = [math.prod(shape) for _, shape, _ in s.rows]
  covered: list[list[tuple[int, int]]] = [[] for _ in sizes]
  for k, c in enumerate(s.chunks):
    for r, a, b in c.slices:
      if r >= len(sizes):
        raise ScheduleError(f"chunk{k} names row {r}, but the schedule has {len(sizes)} rows.")
      path, _, dtype = s.rows[r]
      if dtype != c.dtype:
        raise ScheduleError(f"chunk{k} has dtype {c.dtype} but holds leaf {path!r} of dtype {dtype}; one "
                            f"dtype per chunk.")
      if b > sizes[r]:
        raise ScheduleError(f"chunk{k} slices leaf {path!r} at [{a}:{b}], past its {sizes[r]} elements.")
      covered[r].append((a, b))
  for r, spans in enumerate(covered):
    spans.sort()
    pos = 0
    for a, b in spans:
      if a != pos:
        what = "repeats" if a < pos else "drops"
        raise ScheduleError(f"the schedule {what} elements of leaf {s.rows[r][0]!r} at "
                            f"[{min(a, pos)}:{max(a, pos)}]; every element must be sent exactly once.")
      pos = b
    if pos != sizes[r]:
      raise ScheduleError(f"the schedule drops elements of leaf {s.rows[r][0]!r} at [{pos}:{sizes[r]}]; "
                          f"every element must be sent exactly once.")
