"""A Schedule's structural invariants, checked on construction (links, gathers, coverage); each error
names the chunk, gather or leaf.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._errors import ScheduleError
from ._tree import RowsInfo
from ._types import is_int


def check_links(s: Any) -> None:
  links = s.links
  if not isinstance(links, (tuple, list)) or not all(map(is_int, links)):
    raise ScheduleError(f"schedule links={links!r}: expected a tuple of link indices (ints), one per "
                        f"issued all-reduce, or () for one link.")
  links = tuple(int(x) for x in links)
  object.__setattr__(s, "links", links)
  if links and (len(links) != s.num_allreduces or min(links) < 0):
    raise ScheduleError(f"schedule links={links[:8]}{'...' if len(links) > 8 else ''} ({len(links)} "
                        f"entries): expected {s.num_allreduces} link indices >= 0, one per issued "
                        f"all-reduce, or () for one link. Plan again.")


def check_gathers(s: Any) -> None:
  """A sharded schedule's gathers: a partition of the chunk indices, one dtype each; no deferral, one link."""
  gathers = s.gathers
  if not isinstance(gathers, (tuple, list)) or not all(isinstance(g, (tuple, list)) for g in gathers):
    raise ScheduleError(f"schedule gathers={gathers!r}: expected a tuple of all-gathers, each a tuple of "
                        f"chunk indices (ints), or () for an all-reduce schedule.")
  if not gathers:
    object.__setattr__(s, "gathers", ())
    return
  chunks = s.chunks
  n = len(chunks)
  out, seen = [], {}
  for g, ks in enumerate(gathers):
    if not ks:
      raise ScheduleError(f"gather {g} is empty; every all-gather gathers the shards of at least one "
                          f"reduce-scatter chunk. Drop it, or plan again (prophet_jax.plan(..., 'dear')).")
    if not all(map(is_int, ks)):
      raise ScheduleError(f"gather {g} is {tuple(ks)!r}: expected chunk indices (ints) into the "
                          f"schedule's {n} chunks (issue order).")
    ks = tuple(int(k) for k in ks)
    for k in ks:
      if not 0 <= k < n:
        raise ScheduleError(f"gather {g} names chunk {k}, but the schedule has {n} chunks (0 to {n - 1}, "
                            f"issue order). Plan again (prophet_jax.plan(..., 'dear')).")
      if k in seen:
        raise ScheduleError(f"chunk{k} is in gather {seen[k]} and gather {g}; every reduce-scatter "
                            f"chunk's shard is all-gathered exactly once. Plan again.")
      seen[k] = g
    dtypes = sorted({chunks[k].dtype for k in ks})
    if len(dtypes) > 1:
      raise ScheduleError(f"gather {g} (chunks {ks}) mixes dtypes {dtypes}; one all-gather gathers one "
                          f"dtype. Make one gather per dtype.")
    out.append(ks)
  missing = [k for k in range(n) if k not in seen]
  if missing:
    raise ScheduleError(f"chunk(s) {missing[:8]}{' ...' if len(missing) > 8 else ''} are in no gather; in a "
                        f"sharded schedule every reduce-scatter chunk's shard is all-gathered once (the "
                        f"other devices would miss its update). Add them to a gather, or plan again.")
  deferring = [i for i, b in enumerate(s.buckets) if b.defer]
  if deferring:
    raise ScheduleError(f"a sharded schedule (gathers) cannot hold deferral groups, but bucket "
                        f"{deferring[0]} has defer={s.buckets[deferring[0]].defer}: a deferred chunk "
                        f"would leave its shard's update one step late on one device only. Use "
                        f"'dlcp' or 'dear', not both.")
  if s.links:
    raise ScheduleError(f"a sharded schedule (gathers) runs on one link (one tie chain of "
                        f"reduce-scatters, then one of all-gathers), but it has links="
                        f"{s.links[:8]}{'...' if len(s.links) > 8 else ''}. Drop `links`, or plan it "
                        f"with network.links=1.")
  object.__setattr__(s, "gathers", tuple(out))


def check_coverage(s: Any, info: RowsInfo) -> None:
  """Every element of every row in exactly one chunk, once, in a chunk of the row's dtype."""
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
    coverage_error(s)


def coverage_error(s: Any) -> None:
  """Raises the ScheduleError that names the first chunk or leaf breaking coverage."""
  sizes = [math.prod(shape) for _, shape, _ in s.rows]
  covered: list[list[tuple[int, int]]] = [[] for _ in sizes]
  for k, c in enumerate(s.chunks):
    for r, a, b in c.slices:
      if r >= len(sizes):
        raise ScheduleError(f"chunk{k} names row {r}, but the schedule has {len(sizes)} rows (0 to "
                            f"{len(sizes) - 1}, its `rows` in profile order): the chunk was planned for "
                            f"another tree, or the file was edited. Plan again for this profile "
                            f"(prophet_jax.plan).")
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
        raise ScheduleError(f"the schedule {'repeats' if a < pos else 'drops'} elements of leaf {s.rows[r][0]!r} at "
                            f"[{min(a, pos)}:{max(a, pos)}]; every element must be sent exactly once.")
      pos = b
    if pos != sizes[r]:
      raise ScheduleError(f"the schedule drops elements of leaf {s.rows[r][0]!r} at [{pos}:{sizes[r]}]; "
                          f"every element must be sent exactly once.")
