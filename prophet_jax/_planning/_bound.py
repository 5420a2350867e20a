"""A proven lower bound on the simulated iteration of every schedule (pure numpy; the proof is
docs/design.md, "The lower bound").
"""

from __future__ import annotations

import collections
import heapq
import math

import numpy as np

from .._values._checks import check_max_defer, check_values
from ._core import Problem, background_flows, problem
from ._fsdp_bound import fsdp_bound
from .._values._network import NetworkModel
from .._values._types import GradientProfile, is_bool, is_int

# Above this many (layers x layers x rows), the pipelined-step bound uses layer prefixes and single
# layers only, instead of every contiguous range of layers (a weaker but still valid bound).
_INTERVAL_WORK = 250_000
# ... and above this many (layers x rows), every k-th prefix only, so a 1,000-leaf bound stays ~10 ms.
_PREFIX_WORK = 200_000
# The batching terms (an O(rows) dynamic program in Python each): every range of layers when
# (number of ranges) x rows is below this, else the whole model and this many evenly spaced prefixes.
_BATCH_WORK = 100_000
_BATCH_PREFIXES = 16
# The split term's held rows (its cost grows with their square): at most this many, the latest.
_SPLIT_HELD = 8


def lower_bound(profile: GradientProfile, network: NetworkModel, *, cross_step: bool = False,
                max_defer: float = 0.0, sharded: bool | str | None = None, micro_batches: int = 1) -> float:
  """A lower bound on the iteration time of every schedule, in seconds.

  min(B_allreduce, B_sharded) (and B_fsdp for a sharded profile): each family's bound is at most the
  simulated iteration of every schedule of that family (proofs: docs/design.md, "The lower bound";
  docs/fsdp.md, "B_fsdp and its proof"). Under pressure, the mean of the per-sample bounds.

  Args:
    profile: the per-leaf readiness and compute times.
    network: the all-reduce cost model (with its pressure, if any).
    cross_step: the step mode (as in `simulate`).
    max_defer: the largest fraction of elements a schedule may defer per step, in [0, 1) (0: lossless).
    sharded: None: every schedule; False: all-reduce schedules (B_allreduce); True: `dear`'s sharded
      schedules (B_sharded, one link); 'fsdp': FSDP / HSDP schedules (B_fsdp, calm).
    micro_batches: with sharded='fsdp', FSDP steps of this many micro-batches (each as profiled).

  Returns:
    The bound in seconds.

  Raises:
    TypeError: an argument of the wrong type.
    ValueError: `max_defer` outside [0, 1); `sharded=True` with `network.links > 1`.

  Examples:
    >>> from prophet_jax import GradientProfile, NetworkModel
    >>> p = GradientProfile.from_rows(
    ...     [dict(path="a/w", layer="a", shape=(250,), dtype="float32", nbytes=1000, ready_s=2.0,
    ...           fwd_s=1.0)], forward_s=1.0, backward_s=2.0)
    >>> lower_bound(p, NetworkModel(alpha_s=0.5, beta_s_per_byte=0.001, workers=2))  # 2 + (1 + 1) + 1
    5.0
  """
  check_values("lower_bound()", profile=profile, network=network, cross_step=cross_step)
  check_max_defer("lower_bound()", max_defer)
  fsdp_only = isinstance(sharded, str) and sharded == "fsdp"
  if sharded is not None and not is_bool(sharded) and not fsdp_only:
    raise TypeError(f"lower_bound(sharded={sharded!r}): expected None (every schedule), False "
                    f"(all-reduce schedules), True (sharded schedules) or 'fsdp' (FSDP schedules).")
  prob = problem(profile, network, cross_step=bool(cross_step))
  if not is_int(micro_batches) or micro_batches < 1 or (micro_batches > 1 and not fsdp_only):
    raise ValueError(f"lower_bound(micro_batches={micro_batches!r}): an integer >= 1; above 1 only with "
                     f"sharded='fsdp' (FSDP steps that accumulate micro-batches).")
  if fsdp_only:
    return fsdp_bound(prob, micro_batches)
  if sharded and network.links != 1:
    raise ValueError(f"lower_bound(sharded=True): sharded schedules run on one link, but network.links="
                     f"{network.links}; use network.replace(links=1).")
  deferred = _deferred_bytes(prob, float(max_defer))
  families = []
  if not sharded:
    families.append(lambda b: _bound(prob, b, deferred))
  if sharded is not False and network.links == 1 and prob.live:
    families.append(lambda b: _sharded_bound(prob, b))
  if (sharded is None and profile.sharded and network.links == 1
      and profile.shard_count * profile.replica_count == network.workers):
    families.append(lambda b: fsdp_bound(prob))      # FSDP is simulated calm: its bound is too
  q = network.pressure
  if q is None or q.background_flows == 0:
    return float(min(f(prob.per_byte_s) for f in families))
  values, counts = np.unique(background_flows(q), return_counts=True)
  # each family's mean over the samples' flows, the least of them
  return float(min(float(np.dot([f(prob.per_byte_s * (1.0 + float(v))) for v in values], counts) / counts.sum())
                   for f in families))


def _sharded_bound(prob: Problem, b_full: float) -> float:
  """B_sharded ("Sharded schedules" in docs/design.md, "The lower bound"), with an all-reduce's per-byte
  cost `b_full`; one link, sent rows present.
  """
  a, b = 0.5 * prob.startup_s, 0.5 * b_full
  ready, nbytes, dtype, layer = prob.row_ready_s, prob.row_nbytes, prob.row_dtype_code, prob.row_layer
  sent, idx, order, nd = _latest_first(prob)
  r_s, b_s, d_s = ready[order], nbytes[order], dtype[order]
  k = _dtypes_so_far(np.ones(order.size, dtype=bool), d_s, nd)
  thr = float(np.max(r_s + k * a + b * np.cumsum(b_s)))          # max_t (t + W'(S_t))
  w_all = float(k[-1] * a + b * b_s.sum())
  forward, backward = prob.forward_s, prob.backward_s
  update = float(prob.row_update_s[sent].sum()) / prob.network.workers
  rs = max(thr, _makespan_per_dtype(r_s, b_s, d_s, nd, a, b)) if prob.overlap else max(backward + w_all, thr)
  if not prob.cross_step:
    if prob.overlap:
      return float(max(backward, rs) + max(w_all, update + a) + forward)
    return float(rs + update + w_all + forward)
  ftail = prob.layer_fwd_tail_s
  bound = max(backward + forward, _unsent(prob, sent, ftail))
  if not prob.overlap:
    return float(max(bound, rs + w_all + forward))
  q_row = ftail[layer[idx]]
  by_q = np.lexsort((idx, -q_row))                                 # ftail descending, then row order
  q_s, bq_s, dq_s = q_row[by_q], nbytes[idx][by_q], dtype[idx][by_q]
  for m in _dtype_masks(dq_s, nd):
    bound = max(bound, rs + _gather_chain(bq_s[m], q_s[m], a, b))
  return float(bound)


def _gather_chain(nbytes: np.ndarray, tail: np.ndarray, a: float, b: float) -> float:
  """H: the least max of (group end + its largest tail) over contiguous partitions of the rows in order,
  messages back to back from 0, each a + b·bytes; reverse program h[i] = min_j max(a + b·bytes(i..j) +
  tail_i, a + b·bytes(i..j) + h[j+1]).
  """
  n = nbytes.size
  if n == 0:
    return -np.inf
  prefix = np.concatenate([[0.0], np.cumsum(nbytes)])
  h = np.full(n + 1, -np.inf)
  for i in range(n - 1, -1, -1):
    span = a + b * (prefix[i + 1:] - prefix[i])                   # groups i..j, j = i..n-1
    h[i] = float(np.min(span + np.maximum(tail[i], h[i + 1:])))
  return float(h[0])


def _deferred_bytes(prob: Problem, max_defer: float) -> float:
  """D: the most bytes floor(max_defer·E) elements can hold (the largest itemsizes first)."""
  if max_defer <= 0:
    return 0.0
  left = math.floor(max_defer * sum(prob.size))
  out = 0.0
  for i in sorted(prob.live, key=lambda r: -prob.itemsize[r]):
    take = min(left, prob.size[i])
    out += take * prob.itemsize[i]
    left -= take
    if left <= 0:
      break
  return out


def _bound(prob: Problem, b: float, deferred: float) -> float:
  """The bound of `lower_bound` with per-byte cost `b` and at most `deferred` bytes deferred."""
  cross_step, network = prob.cross_step, prob.network
  a, links = prob.startup_s, prob.links
  nl = len(prob.layers)
  ready, nbytes, layer, dtype = prob.row_ready_s, prob.row_nbytes, prob.row_layer, prob.row_dtype_code
  forward, update, backward = prob.forward_s, prob.update_s, prob.backward_s

  def work(bytes_, k):  # W for arrays of (bytes, dtype count)
    if deferred:
      bytes_ = np.maximum(bytes_ - deferred, 0.0)
    return np.maximum(a * np.ceil(k / links), (k * a + b * bytes_) / links)

  # rows sorted by ready time, latest first: prefix sums over this order are the sets S_t.
  sent, _, order, nd = _latest_first(prob)
  r_s, b_s, d_s, l_s = ready[order], nbytes[order], dtype[order], layer[order]
  n = order.size

  def thr_max(mask: np.ndarray) -> np.ndarray:
    """max_t (t + W(R ∩ S_t)) for each set R (a boolean mask over `order`), at every sorted position (ties
    count part of S_t: smaller, still valid).
    """
    cb = np.cumsum(np.where(mask, b_s, 0.0), axis=-1)
    return np.where(mask, r_s + work(cb, _dtypes_so_far(mask, d_s, nd)), -np.inf).max(axis=-1)

  if n:
    thr_all = float(thr_max(np.ones((1, n), dtype=bool))[0])   # every row
    w_all = float(work(np.float64(b_s.sum()), np.float64(len({int(d) for d in d_s}))))   # every row, every dtype
  else:
    thr_all, w_all = -np.inf, 0.0
  if network.overlap:
    t0 = max(backward, thr_all) if not cross_step else backward
  else:
    t0 = max(backward + w_all, thr_all)
  if not cross_step:
    if network.overlap and links == 1 and n and not deferred:
      t0 = max(t0, _makespan_per_dtype(r_s, b_s, d_s, nd, a, b))
    return float(t0 + update + forward)

  tail = prob.layer_tail_s
  bound = max(t0 + forward, _unsent(prob, sent, tail))
  if n:
    has_sent = np.zeros(nl, dtype=bool)
    has_sent[l_s] = True
    tail_sent = np.where(has_sent, tail, np.inf)
    if nl * nl * n <= _INTERVAL_WORK:
      for i in range(nl):
        if not has_sent[i:].any():
          break
        ends = np.arange(i, nl)
        mask = (l_s[None, :] >= i) & (l_s[None, :] <= ends[:, None])
        ok = mask.any(axis=1)
        mins = np.minimum.accumulate(tail_sent[i:])
        bound = max(bound, float((thr_max(mask[ok]) + mins[ok]).max()))
    else:
      # prefixes 0..l (rows as they join): every one, or every `step`-th and the last when
      # layers x rows is large (any subset of the terms is still a valid bound), and single layers
      step = max(1, -(-nl * n // _PREFIX_WORK))
      ends = np.unique(np.r_[np.arange(step - 1, nl, step), nl - 1])
      mask = l_s[None, :] <= ends[:, None]
      ok = mask.any(axis=1)
      mins = np.minimum.accumulate(tail_sent)[ends]
      bound = max(bound, float((thr_max(mask[ok]) + mins[ok]).max()))
      bound = max(bound, _single_layers(r_s, b_s, d_s, l_s, nd, work, tail))
    if links == 1 and not deferred:
      bound = max(bound, a + _jackson_lmax(r_s, b * b_s, tail[l_s]))
      # batching: the last chunk holding rows of a layer range J ends no earlier than the best
      # one-link batching of J's rows alone (of each dtype alone), then waits >= min tail over J.
      for lo, hi in _ranges(nl, n):
        in_j = (l_s >= lo) & (l_s <= hi)
        for m in _dtype_masks(d_s, nd, in_j):
          bound = max(bound, _batched_makespan(r_s[m][::-1], b_s[m][::-1], a, b) + float(tail[l_s[m]].min()))
        # split: the rows of J ready no earlier than every row outside J ("hold")
        t_star = float(r_s[~in_j].max()) if (~in_j).any() else -np.inf
        hold = in_j & (r_s >= t_star)
        if hold.sum() > _SPLIT_HELD:   # keep the latest rows only: still later than all the others
          hold &= np.cumsum(hold) <= _SPLIT_HELD      # r_s is sorted latest first
        if hold.any():
          other = ~hold
          bound = max(bound, _split_term(r_s[other][::-1], b_s[other][::-1], r_s[hold][::-1],
                                         b_s[hold][::-1], a, b, float(tail[l_s[hold]].min()),
                                         float(tail_sent.min())))
  return float(bound)


def _ranges(nl: int, n: int) -> list[tuple[int, int]]:
  """The layer ranges [lo, hi] that get the batching term: all of them on small profiles, else the whole
  model and up to `_BATCH_PREFIXES` evenly spaced prefixes.
  """
  if nl * (nl + 1) // 2 * n <= _BATCH_WORK:
    return [(lo, hi) for lo in range(nl) for hi in range(lo, nl)]
  ends = np.unique(np.linspace(0, nl - 1, min(nl, _BATCH_PREFIXES)).round().astype(int))
  return [(0, int(e)) for e in ends]


def _makespan_per_dtype(r_s: np.ndarray, b_s: np.ndarray, d_s: np.ndarray, nd: int, a: float, b: float
                        ) -> float:
  """The largest M over every row and over each dtype's rows alone; rows given latest first."""
  return max(_batched_makespan(r_s[m][::-1], b_s[m][::-1], a, b) for m in _dtype_masks(d_s, nd))


def _latest_first(prob: Problem) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
  """(rows sent, their indices, those indices latest ready first (ties in row order), dtype count)."""
  sent = prob.row_nbytes > 0
  idx = np.flatnonzero(sent)
  return sent, idx, idx[np.argsort(-prob.row_ready_s[idx], kind="stable")], int(prob.row_dtype_code.max()) + 1


def _dtypes_so_far(mask: np.ndarray, d_s: np.ndarray, nd: int) -> np.ndarray:
  """Per position (last axis), how many dtypes the rows in `mask` up to it hold."""
  k = np.zeros(mask.shape)
  for d in range(nd):
    k += np.cumsum(mask & (d_s == d), axis=-1) > 0
  return k


def _dtype_masks(d_s: np.ndarray, nd: int, base: np.ndarray | None = None) -> list[np.ndarray]:
  """`base` (all rows when None), then with several dtypes each dtype's part of it: the non-empty ones."""
  base = np.ones(d_s.size, dtype=bool) if base is None else base
  return [m for m in [base] + ([base & (d_s == d) for d in range(nd)] if nd > 1 else []) if m.any()]


def _unsent(prob: Problem, sent: np.ndarray, tail: np.ndarray) -> float:
  """The latest end of a row in no message: its ready time plus its layer's `tail` (-inf: none)."""
  zero = ~sent
  return float(np.max(prob.row_ready_s[zero] + tail[prob.row_layer[zero]], initial=-np.inf))


def _batched_makespan(ready: np.ndarray, nbytes: np.ndarray, a: float, b: float) -> float:
  """M: the least one-link end of the last chunk over contiguous merges of rows in ready order."""
  return float(_batched_ends(ready, nbytes, a, b)[-1])


def _batched_ends(ready: np.ndarray, nbytes: np.ndarray, a: float, b: float) -> np.ndarray:
  """The least one-link end of the last chunk over contiguous partitions of rows in ready order, per prefix.

  F[0] = 0; F[e+1] = min_s max(F[s], r_e) + a + b (P[e+1] - P[s]). F is nondecreasing, so the s with
  F[s] <= r_e form a prefix: s = k-1 is best there; beyond it a monotone deque keeps the least
  F[s] - b P[s]: O(n).
  """
  r = ready.tolist()
  pb = [0.0]
  for x in nbytes.tolist():
    pb.append(pb[-1] + x)
  n = len(r)
  f = [0.0] * (n + 1)
  g: list[float] = [0.0] * (n + 1)   # F[s] - b P[s]
  window: collections.deque[int] = collections.deque()   # indices s in [k, e], g increasing
  k = 0
  for e in range(n):
    s_new = e                       # index s = e joins the candidates
    g[s_new] = f[s_new] - b * pb[s_new]
    while window and g[window[-1]] >= g[s_new]:
      window.pop()
    window.append(s_new)
    while k <= e and f[k] <= r[e]:
      k += 1
    while window and window[0] < k:
      window.popleft()
    best = np.inf
    if k > 0:
      best = r[e] + a + b * (pb[e + 1] - pb[k - 1])
    if window:
      best = min(best, g[window[0]] + a + b * pb[e + 1])
    f[e + 1] = best
  return np.asarray(f)


def _split_term(r_other: np.ndarray, b_other: np.ndarray, r_hold: np.ndarray, b_hold: np.ndarray,
                a: float, b: float, tail_hold: float, tail_min: float) -> float:
  """The split lemma's bound: rows `hold` (ascending ready, none earlier than any `other` row) and tails."""
  k = r_other.size
  po = np.r_[0.0, np.cumsum(b_other)]
  fo = _batched_ends(r_other, b_other, a, b)       # fo[i]: the best end of the i earliest others
  ph = np.cumsum(b_hold)
  blocks: list[np.ndarray] = []                       # F after hold row j, for every i = 0..k
  for j, (rj, bj) in enumerate(zip(r_hold.tolist(), b_hold.tolist())):
    cand = np.minimum.accumulate(np.maximum(fo, rj) - b * po)       # cut among the others
    for jp in range(j):                                               # cut after hold row jp
      cand = np.minimum(cand, np.maximum(blocks[jp], rj) - b * (po + ph[jp]))
    blocks.append(cand + a + b * (po + ph[j]))
  m = blocks[-1]                                      # m[i] = M(hold + the i earliest others)
  total = po[k] + ph[-1]
  f1 = m + tail_hold
  if k == 0:
    return float(f1[0])
  f2_next = np.empty(k)                               # f2 at the right end of [y_i, y_{i+1}]
  f2_next[:k - 1] = m[1:k] + a + b * (total - po[1:k] - ph[-1])
  f2_next[k - 1] = m[k] + a                           # the limit y -> total of m(y) + a + b(total - y)
  f2_next += tail_min
  return float(min(f1[k], np.min(np.maximum(f1[:k], f2_next))))


def _jackson_lmax(release: np.ndarray, work: np.ndarray, delivery: np.ndarray) -> float:
  """Optimal preemptive max(C_i + q_i) on one machine with releases (Jackson's rule: run the released job
  of largest q; optimal for 1|r_j,pmtn|L_max).
  """
  order = np.argsort(release, kind="stable")
  rel, remaining, q = release[order].tolist(), work[order].tolist(), delivery[order].tolist()
  n = len(rel)
  heap: list[tuple[float, int]] = []
  t, i, best = 0.0, 0, -np.inf
  while i < n or heap:
    if not heap:
      t = max(t, rel[i])
    while i < n and rel[i] <= t:
      heapq.heappush(heap, (-q[i], i))
      i += 1
    nq, j = heap[0]
    nxt = rel[i] if i < n else np.inf
    if t + remaining[j] <= nxt:
      t += remaining[j]
      heapq.heappop(heap)
      best = max(best, t - nq)
    else:
      remaining[j] -= nxt - t
      t = nxt
  return float(best)


def _single_layers(r_s, b_s, d_s, l_s, nd, work, tail) -> float:
  """max over layers j and t of t + W(rows of j ∩ S_t) + tail(j), in O(rows log rows)."""
  o = np.lexsort((-r_s, l_s))         # by layer, then latest first
  r, by, d, l = r_s[o], b_s[o], d_s[o], l_s[o]
  first = np.r_[True, l[1:] != l[:-1]]
  seg = np.cumsum(first) - 1
  starts = np.flatnonzero(first)
  cb = np.cumsum(by)
  cb -= (cb - by)[starts][seg]
  k = np.zeros(r.size)
  for dt in range(nd):
    ind = (d == dt).astype(np.int64)
    c = np.cumsum(ind)
    c -= (c - ind)[starts][seg]
    k += c > 0
  return float(np.max(r + work(cb, k) + tail[l]))
