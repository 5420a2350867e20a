"""Brute-force optima over schedules of whole leaves, and random instances (pure numpy; for the tests).

- `best_contiguous(profile, network)`: the best schedule among every contiguous merge of the ready
  order (whole leaves, one dtype per chunk, chunks in ready order), for the plain step
  (cross_step=False): MG-WFBP's search space. 2^(n-1) partitions, evaluated together with numpy (one
  link); 14 leaves take a few milliseconds.
- `best_ordered(profile, network, cross_step=True)`: the best schedule among every partition of the
  leaves into chunks (one dtype each) times every issue order of the chunks (the ordered set partitions:
  545,835 of them for 8 leaves). With one link and overlap it is an exact dynamic program over the set
  of leaves already sent, keeping the Pareto front of (link free time, max over sent chunks of
  end + tail) — both only ever grow and the rest of the schedule depends on nothing else, so a
  dominated state can never lead to a better schedule; it handles 8 leaves in well under a second.
  Other networks fall back to explicit enumeration (`_enumerate_ordered`, up to 7 leaves).

- `best_sharded(profile, network, cross_step=...)`: the best *sharded* schedule (reduce-scatters,
  all-gathers: `Schedule.gathers`) over every partition of the leaves into reduce-scatter chunks (one
  dtype each) times every issue order, times every partition of those chunks into all-gathers (one
  dtype each) times every all-gather order, each scored by the simulator's own engine
  (`_sharded.sharded_run`); explicit enumeration, up to `MAX_SHARDED_LEAVES` (4) leaves.

All return `(best_time_s, schedule)`; `simulate(schedule, ...)` gives the same time (up to rounding).
Rows with nbytes=0 are in no chunk, as in every schedule.

`random_profile`, `random_network` and `random_schedule` make the random instances that the tests and
benches share: schedules with random slices, merges and orders; `random_deferral` turns some of a
schedule's chunks into deferral groups (`Bucket.defer`), `split_group` makes one.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import numpy as np

from prophet_jax._planning._core import chunk_arrays, iteration_s, problem
from prophet_jax import Bucket, Chunk, GradientProfile, NetworkModel, ProfileRow, Schedule
from prophet_jax._values._types import itemsize
from prophet_jax._values._checks import check_values

__all__ = ["best_contiguous", "best_ordered", "best_sharded", "random_profile", "random_network", "random_schedule",
           "random_deferral", "split_group", "random_sharded"]

MAX_CONTIGUOUS_LEAVES = 22
MAX_ORDERED_LEAVES = 12
MAX_ENUMERATED_LEAVES = 7
MAX_SHARDED_LEAVES = 4


def _sent_rows(profile: GradientProfile) -> list[int]:
  return [i for i in profile.ready_order() if profile.rows[i].nbytes > 0]


def _schedule(profile: GradientProfile, groups: Sequence[Sequence[int]], policy: str,
              cross_step: bool, predicted_s: float) -> Schedule:
  chunks = []
  for g in groups:
    rows = sorted(g)
    chunks.append(Chunk(slices=tuple((r, 0, profile.rows[r].size) for r in rows),
                        dtype=profile.rows[rows[0]].dtype))
  return Schedule(buckets=tuple(Bucket(chunks=(c,)) for c in chunks), rows=profile.tree_rows(),
                  policy=policy, cross_step=cross_step, predicted_s=float(predicted_s))


def _check_args(fn: str, profile: GradientProfile, network: NetworkModel) -> None:
  check_values(f"{fn}()", profile=profile, network=network)
  if network.skew and not network.overlap:
    raise ValueError(f"{fn}: brute force models workers that keep pace (skew=0); got skew="
                     f"{network.skew:g}. Use network.replace(skew=0.0): with one link, skew adds the same "
                     f"skew x compute to every schedule.")


# --------------------------------------------------------------------------------------------------
# contiguous merges of the ready order (plain step)


def best_contiguous(profile: GradientProfile, network: NetworkModel) -> tuple[float, Schedule]:
  """The best contiguous merge of the ready order (whole leaves, one dtype per chunk), plain step.

  Args:
    profile: at most `MAX_CONTIGUOUS_LEAVES` (22) rows with nbytes > 0.
    network: any NetworkModel (one link: all partitions at once in numpy; several: one by one).

  Returns:
    (iteration_s, schedule) of the best partition (the first found among equals), cross_step=False.

  Raises:
    ValueError: too many leaves for exhaustive search.
  """
  _check_args("best_contiguous", profile, network)
  seq = _sent_rows(profile)
  n = len(seq)
  if n > MAX_CONTIGUOUS_LEAVES:
    raise ValueError(f"best_contiguous: the profile has {n} leaves to send; exhaustive search handles "
                     f"at most {MAX_CONTIGUOUS_LEAVES} (2^(n-1) partitions). Use plan(policy='auto').")
  prob = problem(profile, network, cross_step=False)
  if n == 0:
    t = iteration_s(prob, np.zeros(0), np.zeros(0), 0.0)
    return t, _schedule(profile, [], "brute-contiguous", False, t)
  ready = prob.row_ready_s[seq]
  nbytes = prob.row_nbytes[seq]
  dtypes = [profile.rows[i].dtype for i in seq]
  forced = [i for i in range(n - 1) if dtypes[i] != dtypes[i + 1]]   # cut between dtypes
  free = [i for i in range(n - 1) if dtypes[i] == dtypes[i + 1]]
  p = 1 << len(free)
  codes = np.arange(p, dtype=np.int64)
  cut = np.zeros((n, p), dtype=bool)                                   # cut after position i
  for j, i in enumerate(free):
    cut[i] = (codes >> j) & 1
  for i in forced:
    cut[i] = True
  cut[n - 1] = True
  a, b = prob.startup_s, prob.per_byte_s
  if network.links == 1:
    acc = np.zeros(p)
    end = np.zeros(p)      # link free time (overlap) / end of the last chunk (no overlap)
    csum = np.zeros(p)     # sum of durations so far (no overlap)
    bw_c = np.zeros(p)     # sum of durations issued before backward ends (no overlap)
    for i in range(n):
      acc += nbytes[i]
      d = a + b * acc
      if network.overlap:
        end = np.where(cut[i], np.maximum(end, ready[i]) + d, end)
      else:
        # ready is sorted, so the progress at issue is ready[i]: end = q + C (see prophet_jax._planning._core)
        csum = np.where(cut[i], csum + d, csum)
        end = np.where(cut[i], ready[i] + csum, end)
        if ready[i] < prob.backward_s:
          bw_c = np.where(cut[i], csum, bw_c)
      acc = np.where(cut[i], 0.0, acc)
    bw_end = prob.backward_s + (0.0 if network.overlap else bw_c)
    times = np.maximum(bw_end, end) + prob.after_s
  else:
    times = np.empty(p)
    for q in range(p):
      times[q] = _eval_groups(prob, _groups_of(seq, cut[:, q]))
  best = int(np.argmin(times))
  groups = _groups_of(seq, cut[:, best])
  return float(times[best]), _schedule(profile, groups, "brute-contiguous", False, times[best])


def _groups_of(seq: Sequence[int], cuts: np.ndarray) -> list[list[int]]:
  groups, cur = [], []
  for i, r in enumerate(seq):
    cur.append(r)
    if cuts[i]:
      groups.append(cur)
      cur = []
  return groups


def _eval_groups(prob, groups: Sequence[Sequence[int]]) -> float:
  ready, nbytes, tail, _, _ = chunk_arrays(prob, [[(r, 0, prob.size[r]) for r in g] for g in groups])
  return iteration_s(prob, ready, prob.durations(nbytes), tail)


# --------------------------------------------------------------------------------------------------
# every partition x every order


def best_ordered(profile: GradientProfile, network: NetworkModel, *,
                 cross_step: bool = True) -> tuple[float, Schedule]:
  """The best schedule over every partition of the leaves into chunks and every issue order.

  Whole leaves, one dtype per chunk. Exact: a Pareto dynamic program over sets of sent leaves for one
  link with overlap (up to `MAX_ORDERED_LEAVES`, 12), explicit enumeration otherwise (up to
  `MAX_ENUMERATED_LEAVES`, 7).

  Args:
    profile: the instance.
    network: the network model.
    cross_step: the step mode to optimise (the pipelined step by default).

  Returns:
    (iteration_s, schedule) of an optimal ordered partition.

  Raises:
    ValueError: too many leaves for exhaustive search.
  """
  _check_args("best_ordered", profile, network)
  cross_step = bool(cross_step)
  seq = sorted(_sent_rows(profile))
  n = len(seq)
  prob = problem(profile, network, cross_step=cross_step)
  policy = "brute-ordered"
  if n == 0:
    t = iteration_s(prob, np.zeros(0), np.zeros(0), 0.0)
    return t, _schedule(profile, [], policy, cross_step, t)
  if network.links != 1 or not network.overlap:
    if n > MAX_ENUMERATED_LEAVES:
      raise ValueError(f"best_ordered: {n} leaves with links={network.links}, overlap="
                       f"{network.overlap} need explicit enumeration, which handles at most "
                       f"{MAX_ENUMERATED_LEAVES}; use one link with overlap (up to "
                       f"{MAX_ORDERED_LEAVES} leaves).")
    best_t, best_g = np.inf, None
    for groups in _ordered_partitions(seq, [profile.rows[r].dtype for r in seq]):
      t = _eval_groups(prob, groups)
      if t < best_t:
        best_t, best_g = t, groups
    return float(best_t), _schedule(profile, best_g, policy, cross_step, best_t)
  if n > MAX_ORDERED_LEAVES:
    raise ValueError(f"best_ordered: the profile has {n} leaves to send; the exact search handles at "
                     f"most {MAX_ORDERED_LEAVES}. Use plan(policy='auto').")
  return _pareto_dp(profile, prob, seq, cross_step, policy)


def _pareto_dp(profile, prob, seq, cross_step, policy) -> tuple[float, Schedule]:
  n = len(seq)
  full = (1 << n) - 1
  size = 1 << n
  ready = prob.row_ready_s[seq]
  nbytes = prob.row_nbytes[seq]
  tail = prob.row_tail_s[seq]
  dt = [profile.rows[r].dtype for r in seq]
  codes = {d: i for i, d in enumerate(dict.fromkeys(dt))}
  dcode = [codes[d] for d in dt]
  # per subset: max ready, bytes, max tail, and its dtype (-1: mixed or empty)
  m_ready = np.full(size, -np.inf)
  m_bytes = np.zeros(size)
  m_tail = np.full(size, -np.inf)
  m_dtype = np.full(size, -1, dtype=np.int64)
  for s in range(1, size):
    low = s & -s
    i = low.bit_length() - 1
    rest = s ^ low
    m_ready[s] = max(m_ready[rest], ready[i])
    m_bytes[s] = m_bytes[rest] + nbytes[i]
    m_tail[s] = max(m_tail[rest], tail[i])
    m_dtype[s] = dcode[i] if rest == 0 or m_dtype[rest] == dcode[i] else -1
  dur = (prob.startup_s + prob.per_byte_s * m_bytes).tolist()
  m_ready_l, m_tail_l, m_dtype_l = m_ready.tolist(), m_tail.tolist(), m_dtype.tolist()
  # front[s]: list of (link_free, max_end_plus_tail, parent_state, parent_index, block)
  fronts: list[list[tuple[float, float, int, int, int]] | None] = [None] * size
  fronts[0] = [(0.0, -np.inf, -1, -1, 0)]
  for s in range(size):
    front = fronts[s]
    if not front or s == full:
      continue
    comp = full ^ s
    b = comp
    while b:
      if m_dtype_l[b] >= 0:
        rb, db, tb = m_ready_l[b], dur[b], m_tail_l[b]
        t = s | b
        tgt = fronts[t]
        if tgt is None:
          tgt = fronts[t] = []
        for idx, (e, m, _, _, _) in enumerate(front):
          e2 = (e if e > rb else rb) + db
          m2 = e2 + tb
          if m > m2:
            m2 = m
          _insert(tgt, (e2, m2, s, idx, b))
      b = (b - 1) & comp
  const = max(prob.backward_s + prob.after_s, prob.floor_s)
  best = min(range(len(fronts[full])), key=lambda i: max(fronts[full][i][1], const))
  t_best = max(fronts[full][best][1], const)
  blocks = []
  s, idx = full, best
  while s:
    _, _, ps, pidx, blk = fronts[s][idx]
    blocks.append(blk)
    s, idx = ps, pidx
  blocks.reverse()
  groups = [[seq[i] for i in range(n) if blk >> i & 1] for blk in blocks]
  return float(t_best), _schedule(profile, groups, policy, cross_step, t_best)


def _insert(front: list, item: tuple) -> None:
  """Adds (e, m, ...) to a Pareto front of (e, m) pairs, both to be minimised; indices of kept items
  stay valid only while the front is being built, which is all the DP needs (a state's front is
  complete before any of its entries is referenced)."""
  e, m = item[0], item[1]
  for f in front:
    if f[0] <= e and f[1] <= m:
      return
  front[:] = [f for f in front if not (e <= f[0] and m <= f[1])]
  front.append(item)


def _ordered_partitions(items: Sequence[int], dtypes: Sequence[str]) -> Iterator[list[list[int]]]:
  """Every ordered partition of `items` into dtype-homogeneous blocks."""
  for part in _set_partitions(list(range(len(items)))):
    if any(len({dtypes[i] for i in blk}) > 1 for blk in part):
      continue
    for perm in itertools.permutations(part):
      yield [[items[i] for i in blk] for blk in perm]


def _set_partitions(xs: list[int]) -> Iterator[list[list[int]]]:
  if not xs:
    yield []
    return
  first, rest = xs[0], xs[1:]
  for p in _set_partitions(rest):
    yield [[first]] + p
    for i in range(len(p)):
      yield p[:i] + [[first] + p[i]] + p[i + 1:]


def _enumerate_ordered(profile: GradientProfile, network: NetworkModel, *,
                       cross_step: bool) -> float:
  """Explicit enumeration of every ordered partition (a cross-check of the dynamic program)."""
  prob = problem(profile, network, cross_step=cross_step)
  seq = sorted(_sent_rows(profile))
  return min(_eval_groups(prob, g) for g in _ordered_partitions(seq, [profile.rows[r].dtype for r in seq]))


# --------------------------------------------------------------------------------------------------
# sharded schedules: every reduce-scatter ordered partition x every all-gather ordered partition


def best_sharded(profile: GradientProfile, network: NetworkModel, *,
                 cross_step: bool = True) -> tuple[float, Schedule]:
  """The best sharded schedule of whole leaves (explicit enumeration, one link).

  Args:
    profile: at most `MAX_SHARDED_LEAVES` rows with nbytes > 0 (and at least one).
    network: one link.
    cross_step: the step mode.

  Returns:
    (iteration_s, schedule) of an optimal sharded schedule (the first found among equals).

  Raises:
    ValueError: too many leaves, none, or several links.
  """
  from prophet_jax._planning._sharded import sharded_arrays, sharded_iteration_s

  _check_args("best_sharded", profile, network)
  if network.links != 1:
    raise ValueError("best_sharded: sharded schedules run on one link.")
  cross_step = bool(cross_step)
  seq = sorted(_sent_rows(profile))
  n = len(seq)
  if not 1 <= n <= MAX_SHARDED_LEAVES:
    raise ValueError(f"best_sharded: {n} leaves to send; enumeration handles 1 to {MAX_SHARDED_LEAVES}.")
  prob = problem(profile, network, cross_step=cross_step)
  dtypes = [profile.rows[r].dtype for r in seq]
  best_t, best = np.inf, None
  for groups in _ordered_partitions(seq, dtypes):
    chunks = [[(r, 0, profile.rows[r].size) for r in sorted(g)] for g in groups]
    cdt = [profile.rows[g[0]].dtype for g in groups]
    for gathers in _ordered_partitions(list(range(len(chunks))), cdt):
      t = sharded_iteration_s(prob, sharded_arrays(prob, chunks, gathers))
      if t < best_t:
        best_t, best = t, (groups, gathers)
  groups, gathers = best
  chunks = tuple(Chunk(slices=tuple((r, 0, profile.rows[r].size) for r in sorted(g)),
                       dtype=profile.rows[g[0]].dtype) for g in groups)
  s = Schedule(buckets=tuple(Bucket(chunks=(c,)) for c in chunks), rows=profile.tree_rows(),
               policy="brute-sharded", cross_step=cross_step, predicted_s=float(best_t),
               gathers=tuple(tuple(g) for g in gathers))
  return float(best_t), s


# --------------------------------------------------------------------------------------------------
# random instances


def random_profile(rng: np.random.Generator, n_rows: int, *, dtypes: Sequence[str] = ("float32",),
                   zero_prob: float = 0.0, max_layers: int | None = None, update: bool = True,
                   backward_s: float = 1.0) -> GradientProfile:
  """A random profile of `n_rows` leaves in priority order, grouped into contiguous layers.

  Ready times fall roughly back to front (a backward pass) with random jitter and ties; layer forward
  times, updates and sizes (1..4096 elements, or 0 with probability `zero_prob`) are random.
  """
  n_rows = int(n_rows)
  if n_rows < 1:
    raise ValueError(f"random_profile(n_rows={n_rows}): need at least one row.")
  max_layers = n_rows if max_layers is None else max(1, min(int(max_layers), n_rows))
  n_layers = int(rng.integers(1, max_layers + 1))
  # contiguous layers: cut points among the rows
  cuts = sorted(rng.choice(np.arange(1, n_rows), size=n_layers - 1, replace=False)) if n_layers > 1 else []
  layer_of = np.searchsorted(np.asarray(cuts, dtype=np.int64), np.arange(n_rows), side="right")
  # per-layer ready times: later layers earlier, with jitter; the first layer at backward_s
  lr = np.sort(rng.uniform(0.0, backward_s, size=n_layers))[::-1].copy()
  lr[0] = backward_s
  if n_layers > 1 and rng.random() < 0.3:
    lr[1] = lr[0]  # a tie
  fwd = rng.uniform(0.0, 0.5 * backward_s, size=n_layers) * (rng.random() < 0.9)
  rows = []
  for i in range(n_rows):
    dtype = str(dtypes[int(rng.integers(len(dtypes)))])
    size = 0 if rng.random() < zero_prob else int(rng.integers(1, 4097))
    l = int(layer_of[i])
    first = i == 0 or layer_of[i - 1] != l
    ready = lr[l] if rng.random() < 0.7 else float(rng.uniform(lr[l + 1] if l + 1 < n_layers else 0.0,
                                                                 lr[l]))
    rows.append(ProfileRow(path=f"layer{l}/p{i}", layer=f"layer{l}", shape=(size,), dtype=dtype,
                           nbytes=size * itemsize(dtype), ready_s=float(min(ready, backward_s)),
                           fwd_s=float(fwd[l]) if first else 0.0,
                           update_s=float(rng.uniform(0, 0.05 * backward_s)) if update else 0.0))
  forward = sum(r.fwd_s for r in rows)
  return GradientProfile(rows=tuple(rows), forward_s=forward, backward_s=backward_s)


def random_network(rng: np.random.Generator, profile: GradientProfile, *, links: int | None = None,
                   overlap: bool | None = None, comm_ratio: float | None = None) -> NetworkModel:
  """A random network scaled to the profile: all-reduce of every byte = comm_ratio x backward."""
  workers = int(rng.integers(2, 9))
  total = max(profile.total_nbytes, 1)
  ratio = float(rng.uniform(0.05, 2.0)) if comm_ratio is None else float(comm_ratio)
  startup_frac = float(rng.uniform(0.0, 0.5))
  comm = ratio * max(profile.backward_s, 1e-9)
  per_byte = comm * (1 - startup_frac) / total
  n = max(len(profile.rows), 1)
  startup = comm * startup_frac / n
  alpha = startup / (2 * (workers - 1))
  beta = per_byte * workers / (2 * (workers - 1))
  return NetworkModel(alpha_s=alpha, beta_s_per_byte=beta, workers=workers,
                      links=int(rng.integers(1, 4)) if links is None else int(links),
                      overlap=bool(rng.random() < 0.8) if overlap is None else bool(overlap))


def random_schedule(profile: GradientProfile, rng: np.random.Generator, *, slice_prob: float = 0.3,
                    in_ready_order: bool = False) -> Schedule:
  """A random valid schedule: rows cut into random slices, merged at random (one dtype per chunk),
  chunks in random order (or sorted by readiness), grouped into random buckets."""
  pieces: list[tuple[int, int, int]] = []
  for i, r in enumerate(profile.rows):
    n = r.size
    if n == 0:
      continue
    k = 1
    if n >= 2 and rng.random() < slice_prob:
      k = int(rng.integers(2, min(n, 3) + 1))
    bounds = [0] + sorted(rng.choice(np.arange(1, n), size=k - 1, replace=False).tolist()) + [n] if k > 1 \
        else [0, n]
    pieces += [(i, a, b) for a, b in zip(bounds[:-1], bounds[1:])]
  order = rng.permutation(len(pieces))
  chunks: list[list[tuple[int, int, int]]] = []
  for j in order:
    p = pieces[j]
    dtype = profile.rows[p[0]].dtype
    same = [c for c in chunks if profile.rows[c[0][0]].dtype == dtype]
    if same and rng.random() < 0.5:
      same[int(rng.integers(len(same)))].append(p)
    else:
      chunks.append([p])
  cs = [Chunk(slices=tuple(c), dtype=profile.rows[c[0][0]].dtype) for c in chunks]
  if in_ready_order:
    cs.sort(key=lambda c: max(profile.rows[r].ready_s for r in c.rows))
  buckets, cur = [], []
  for c in cs:
    cur.append(c)
    if rng.random() < 0.5:
      buckets.append(Bucket(chunks=tuple(cur)))
      cur = []
  if cur:
    buckets.append(Bucket(chunks=tuple(cur)))
  return Schedule(buckets=tuple(buckets), rows=profile.tree_rows(), policy="random")


def split_group(chunk: Chunk, m: int, k: int) -> Bucket:
  """A deferral group of `chunk`'s elements in m consecutive parts (sizes as equal as possible,
  larger first), k deferred."""
  sizes = [b - a for _, a, b in chunk.slices]
  offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
  base, extra = divmod(offsets[-1], m)
  parts, lo = [], 0
  for p in range(m):
    hi = lo + base + (1 if p < extra else 0)
    parts.append(Chunk(slices=tuple((r, a + max(lo, o) - o, a + min(hi, o + n) - o)
                                    for (r, a, _), o, n in zip(chunk.slices, offsets, sizes)
                                    if o < hi and o + n > lo), dtype=chunk.dtype))
    lo = hi
  return Bucket(chunks=tuple(parts), defer=k)


def random_deferral(schedule: Schedule, rng: np.random.Generator, *, prob: float = 0.5,
                    max_parts: int = 5) -> Schedule:
  """`schedule` with each chunk (of at least 2 elements), with probability `prob`, replaced in place
  by a deferral group of its elements: m parts (2..max_parts, at most its size), k <= m // 2
  deferred (k >= 1)."""
  buckets = []
  for b in schedule.buckets:
    kept = []
    for c in b.chunks:
      if c.size >= 2 and rng.random() < prob:
        m = int(rng.integers(2, min(max_parts, c.size) + 1))
        if kept:
          buckets.append(Bucket(chunks=tuple(kept)))
          kept = []
        buckets.append(split_group(c, m, int(rng.integers(1, m // 2 + 1))))
      else:
        kept.append(c)
    if kept:
      buckets.append(Bucket(chunks=tuple(kept), defer=b.defer))
  return Schedule(buckets=tuple(buckets), rows=schedule.rows, policy=schedule.policy)


def random_sharded(profile: GradientProfile, rng: np.random.Generator, **kw) -> Schedule:
  """A random valid sharded schedule: `random_schedule`'s chunks (random slices, merges, order) as the
  reduce-scatters, their indices split at random into dtype-homogeneous gathers in random order (the
  profile must have a row with nbytes > 0)."""
  base = random_schedule(profile, rng, **kw)
  chunks = base.chunks
  order = [int(k) for k in rng.permutation(len(chunks))]
  gathers: list[list[int]] = []
  for k in order:
    same = [g for g in gathers if chunks[g[0]].dtype == chunks[k].dtype]
    if same and rng.random() < 0.5:
      same[int(rng.integers(len(same)))].append(k)
    else:
      gathers.append([k])
  return Schedule(buckets=tuple(Bucket(chunks=(c,)) for c in chunks), rows=profile.tree_rows(),
                  policy="random-sharded", gathers=tuple(tuple(g) for g in gathers))
