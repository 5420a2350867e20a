"""A proven lower bound on the simulated iteration time of every schedule (pure numpy).

`lower_bound(profile, network, *, cross_step=False)` is <= `simulate(s, profile, network,
cross_step=...).iteration_s` for every Schedule `s` of element slices on the network's links: any
merging, splitting and issue order. The proof is in the docstring of `lower_bound`.
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
from .._values._types import GradientProfile, is_bool

__all__ = ["lower_bound"]

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
                max_defer: float = 0.0, sharded: bool | str | None = None) -> float:
  r"""A lower bound on the iteration time of every schedule, in seconds.

  Every schedule is either an all-reduce schedule (chunks of all-reduces, deferral groups included)
  or a sharded one (`Schedule.gathers`: reduce-scatters, the shard update, all-gathers; the `dear`
  policy). The bound is min(B_allreduce, B_sharded): each family's bound is at most the iteration of
  every schedule of that family, so the smaller is at most the iteration of every schedule of either
  (`sharded=False` / `True` return one family's alone). B_allreduce is proven first; B_sharded, with
  its proof, at the end ("Sharded schedules"). Sharded schedules run on one link: with
  `network.links > 1` only B_allreduce applies.

  Notation: a = `network.startup_s`, b = `network.per_byte_s`, L = `network.links`. For a set R of
  rows with nbytes > 0 ("sent rows"), B(R) is their bytes and k(R) the number of distinct dtypes among
  them; W(R) = max(a * ceil(k(R) / L), (k(R) * a + b * B(R)) / L). S_t is the set of sent rows with
  ready_s >= t. F, U: forward and update times; f(l), u(l): those of layer l; tail(l) = u(l) +
  f(l) + ... + f(last layer).

  Lemma (work after a threshold). In every schedule, for every set R of sent rows and every t, the
  chunks holding an element of a row of R ∩ S_t all end by some time E with E >= t + W(R ∩ S_t).
  Proof: such a chunk holds a row ready at >= t, so its readiness (the max over its rows) is >= t and
  it starts at >= t (it starts no earlier than its readiness in every mode: with overlap=False it is
  issued once backward progress, which never runs ahead of the wall clock, has reached it). The chunks
  carry every byte of R ∩ S_t, at least once; each has one dtype, so there are m >= k(R ∩ S_t) of
  them; each lasts a + b * (its bytes). Their total duration, >= k*a + b*B, fits on L links in
  [t, E], each link running one chunk at a time: L (E - t) >= k*a + b*B. By pigeonhole some link runs
  >= ceil(m / L) >= ceil(k / L) of them one after another, each >= a: E - t >= a ceil(k / L). []
  The maximum of t + W(R ∩ S_t) over t is reached at a ready time of a row of R.

  Batching lemma (one link). For every set R of sent rows, the chunks holding an element of R end by
  some E >= M(R), where M(R) is the least one-link end of the last group over the partitions of R's
  rows, in ready order, into contiguous groups of whole rows (each group released at its latest row's
  ready_s and lasting a + b * its bytes; a dynamic program, `_batched_makespan`). Proof: keep only
  those chunks, minus their elements of other rows: readiness and durations only drop, and on one
  link end_k >= max(ready_k, end_{k-1}) + d_k (with equality under overlap), whose value is
  monotone, so the last end of this recurrence, max_k (R_k + sum_{i>=k} (a + b B_i)) over the chunks
  in link order with readiness R_k and B_k bytes, is <= E. Reassign R's bytes, sorted by readiness,
  to the same chunks in order, B_k each; the k-th now has readiness R'_k. More than B_{k+1} + ... +
  B_m bytes are ready at >= R'_k, so one of them sat in an original chunk j <= k: R_j >= R'_k and
  the j-th term dominates the new k-th. A boundary inside a row moves to that row's end (the earlier
  chunk already has that row's readiness, the sizes from it on do not change, later terms shrink, an
  emptied chunk goes). So a contiguous partition of whole rows does at least as well: M(R) <= E. []

  Preemption lemma (one link). Every schedule has iteration >= a + L*, where L* is the least
  max_i (C_i + q_i) of a *preemptive* one-machine schedule of the sent rows, row i released at
  ready_s, needing b * nbytes_i, with q_i = tail(its layer). Proof: run each
  chunk's bytes in the first b * B of its span: each row completes by (end of its last chunk) - a,
  after its release; the chunk's end plus the tail of any row in it is <= iteration (pipelined step,
  below). Jackson's rule (always run the released row of largest q) attains L* (Horn, 1974). []

  Split lemma (one link). Let H ("held") be sent rows each ready no earlier than every other sent
  row, O the other K sent rows in ready order, tail_H the least tail over H's layers, tail_min the
  least over all layers with sent rows, Y_i = H plus the i earliest rows of O, m_i = M(Y_i), and g_j
  = m_j + a + b * (bytes of O after its j earliest rows) + tail_min for j < K, g_K = m_K + a +
  tail_min. Then iteration >= min(m_K + tail_H, min_{i<K} max(m_i + tail_H, g_{i+1})). Proof: let c
  be the last chunk (link order) holding an element of H and Y the bytes of the chunks up to c, so
  Y contains H; by the batching lemma's argument c ends at E >= M(Y), and iteration >= E + tail_H.
  If no chunk follows c, Y is every byte: iteration >= m_K + tail_H. Otherwise the X = total - |Y|
  bytes after c need >= 1 more chunk, all starting after E: the last ends >= E + a + b X, and
  iteration >= E + a + b X + tail_min. Among byte sets Y containing H of a given size y, M is least,
  m(y), for H plus the earliest-ready other bytes (a byte replaced by an earlier-ready one never
  raises M: the recurrence is monotone); m is nondecreasing in y, and m(y) + b (total - y) is
  nonincreasing (extra bytes can join the last chunk, whose readiness, H's latest, stays). So on
  [|Y_i|, |Y_{i+1}|] the larger of the two bounds is >= max(m_i + tail_H, g_{i+1}). []

  Plain step (cross_step=False): iteration = T0 + U + F with T0 = max(backward end, last chunk end).
  - overlap=True: backward end = backward_s, and the lemma with R = every sent row bounds the last
    chunk end: T0 >= max(backward_s, max_t (t + W(S_t))); with one link also T0 >= M(every sent row)
    and T0 >= M(the sent rows of one dtype) for each dtype (relaxations: other rows dropped). For a
    single dtype this is the best contiguous merge, so the bound is then attained.
  - overlap=False: additionally, backward compute advances only while no link is busy, so within
    [0, T0] the backward_s of compute and the instants when some link is busy are disjoint; the
    latter measure >= W(S_0) (the union of the links' busy time is >= each link's busy time and >=
    the total work / L, argued as in the lemma). So T0 >= backward_s + W(S_0).

  Pipelined step (cross_step=True): iteration = fwd_end(last layer) with fwd_end(l) =
  max(fwd_end(l-1), reduced(l) + u(l)) + f(l), fwd_end(-1) = T0 (backward end with overlap; with
  overlap=False the max with the last chunk end, bounded as above). Unrolling: iteration >= T0 + F,
  and iteration >= reduced(j) + tail(j) for every layer j. Now take any contiguous range J of layers
  and any t: the chunk that ends last among those holding an element of a sent row of J ∩ S_t ends at
  E >= t + W(J ∩ S_t) (lemma) and holds a row of some layer j in J that has sent rows, so reduced(j) >=
  E and iteration >= t + W(J ∩ S_t) + min{tail(j) : j in J has sent rows}. A row with nbytes = 0 is
  reduced at its ready time: iteration >= ready_s + tail(its layer). With one link, likewise
  iteration >= M(J's sent rows [of one dtype]) + min tail over J's layers with sent rows (batching
  lemma), the split lemma's bound with H = the rows of J ready no earlier than every row outside J
  (the latest `_SPLIT_HELD` of them, which still qualify), and iteration >= a + L* (preemption lemma). The bound is the max of these terms, over every
  range J when the profile is small, else over single layers and prefixes 0..l (every l, or evenly
  spaced ones on large profiles: a subset of valid terms is still a bound).

  Deferral (`max_defer` = f > 0): a bound on every schedule whose deferral groups defer at most a
  fraction f of the elements per step (`Schedule.max_deferred_fraction <= f`; the `dlcp` policy's
  guarantee), lossless ones included. Such a schedule sends at least B(R) - D bytes for every set R
  of rows, D = the bytes of the floor(f·E) elements of the largest itemsize (E: all elements): a
  group sends m - k slots, each at least as large as any of its chunks, so at least its bytes less
  its k largest chunks. Each slot is ready no earlier than any row of its group and holds every row
  of it, and each group sends >= 1 slot, so the work lemma holds with B(R ∩ S_t) replaced by
  max(0, B(R ∩ S_t) - D), and every term built on it (thresholds, the overlap=False term, the
  pipelined ranges) stays valid. The batching, preemption and split terms are not used then (their
  exchange arguments assume every byte is sent); the bound is weaker but valid. A dlcp schedule may
  beat `lower_bound(..., max_defer=0)`: that is deferral doing what no lossless schedule can.

  Network pressure (`network.pressure`): a message lasts at least its calm time with its sample's
  bandwidth share, a + b·(1 + n_s)·bytes (the tail delays only add), and every lemma above needs only
  that lower limit on each duration. So each sample's iteration is at least the bound for the
  network whose per-byte cost is b·(1 + n_s), and the mean over the samples (what `simulate`
  reports under pressure) at least the mean of those bounds, which is what this returns. The n_s
  are the same draws as `simulate`'s (`_core.background_flows`), independent of the schedule. The
  tail delays are not bounded (they depend on how many messages a schedule sends).

  Sharded schedules (B_sharded). Notation as above with a' = a/2, b' = b/2 (a reduce-scatter or an
  all-gather of n bytes lasts a' + b'·(its padded bytes) >= a' + b'·n), W'(R) = k(R)·a' + b'·B(R) on
  the one link, U' = (update_s of the sent rows) / P, f(l) and F as above, and ftail(l) = f(l) + ... +
  f(last layer). A sharded schedule's chunks are reduce-scatters on the link, then its all-gathers
  (every chunk in one, so they carry every sent byte, in >= one message per dtype), first-in first-out:
  every all-gather starts no earlier than T_rs, the end of the last reduce-scatter.
  (i) The reduce-scatters alone are a one-link schedule of chunks with start-up a' and per-byte b', so
  the work, batching and overlap=False arguments above hold for them with (a', b'): T_rs >= RS :=
  max(max_t (t + W'(S_t)), M'(every sent row), M'(the sent rows of each dtype)) with overlap, T_rs >=
  max_t (t + W'(S_t)) and backward end >= backward_s + W'(S_0) without (M' is M with a', b').
  (ii) Plain step: iteration = max(T0 + U', last all-gather end) + F with T0 = max(backward end, T_rs),
  each all-gather released after the update of its shards (>= T0; the last one at T0 + U'). The
  all-gathers run one at a time after T0: the last ends >= T0 + W'(every sent row), and >= T0 + U' + a'.
  So iteration >= max(backward_s, RS) + max(W'(all), U' + a') + F with overlap; without, the device runs
  the update and the all-gathers in turn: iteration >= max(backward_s + W'(all), max_t (t + W'(S_t)))
  + U' + W'(all) + F.
  (iii) Pipelined step with overlap: iteration = max(backward end + F, max over rows r of (the end of
  the last all-gather holding r) + ftail(layer of r)) (unrolling the forward recurrence; a row with
  nbytes = 0 counts at its ready_s). Relax: every all-gather released at RS (they start >= T_rs >= RS),
  dtypes ignored. For messages in link order with given sizes, refilling them with the rows' bytes
  sorted by ftail, largest first, never raises that max: for each row r, the bytes of r and of the rows
  before it fill messages up to r's new last one, j, past the sizes of messages 1..j-1, so one of
  them sat in a message j' >= j before, in a row r' with ftail(r') >= ftail(r), whose term was >= the
  new term of r. Then a message boundary inside a row moves to the row's start (the earlier message
  ends earlier, the later one's end is unchanged, an emptied message goes and every later one ends
  a' sooner). So iteration >= RS + H, where H is the least max over groups (end + the group's largest
  ftail) over contiguous partitions of the rows in that order, from time 0 (an O(rows²) program,
  `_gather_chain`); likewise for the rows of each dtype alone (the others dropped, which only lowers
  every end). Without overlap the device is serial after backward and the reduce-scatters:
  iteration >= max(backward_s + W'(all), max_t (t + W'(S_t))) + W'(all) + F. Both: iteration >=
  backward_s + F and >= ready_s + ftail(l) of every row with nbytes = 0. []
  Under pressure each sample's B_sharded uses b'·(1 + n_s), as above, and the result is
  min(mean of the B_allreduce, mean of the B_sharded): each schedule's mean is at least its family's.

  Args:
    profile: the per-leaf readiness and compute times.
    network: the all-reduce cost model (its pressure, if any: see above).
    cross_step: the step mode (as in `simulate`).
    max_defer: the largest fraction of the elements a schedule may defer per step, in [0, 1) (0: the
      bound over lossless schedules, the default). Sharded schedules never defer.
    sharded: None (the default): the bound over every schedule, min(B_allreduce, B_sharded), and
      B_fsdp (`_fsdp_bound`) too for a profile whose rows are sharded on a mesh of `network.workers`
      devices. False: over all-reduce schedules only (B_allreduce); True: over `dear`'s sharded
      schedules only (B_sharded); 'fsdp': over FSDP / HSDP schedules only (B_fsdp, calm).

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
  if fsdp_only:
    return fsdp_bound(problem(profile, network, cross_step=bool(cross_step)))
  if sharded and network.links != 1:
    raise ValueError(f"lower_bound(sharded=True): sharded schedules run on one link, but network.links="
                     f"{network.links}; use network.replace(links=1).")
  prob = problem(profile, network, cross_step=bool(cross_step))
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
  means = []
  for f in families:
    bounds = [f(prob.per_byte_s * (1.0 + float(v))) for v in values]
    means.append(float(np.dot(bounds, counts) / counts.sum()))
  return float(min(means))


def _sharded_bound(prob: Problem, b_full: float) -> float:
  """B_sharded of `lower_bound` (its docstring, "Sharded schedules"), per-byte cost `b_full` of an
  all-reduce (so b' = b_full / 2), one link; the problem has sent rows."""
  a, b = 0.5 * prob.startup_s, 0.5 * b_full
  ready, nbytes, dtype, layer = prob.row_ready_s, prob.row_nbytes, prob.row_dtype_code, prob.row_layer
  sent = nbytes > 0
  idx = np.flatnonzero(sent)
  order = idx[np.argsort(-ready[idx], kind="stable")]           # latest first: prefixes are S_t
  r_s, b_s, d_s = ready[order], nbytes[order], dtype[order]
  nd = int(dtype.max()) + 1
  k = np.zeros(order.size)
  for d in range(nd):
    k += np.cumsum(d_s == d) > 0
  thr = float(np.max(r_s + k * a + b * np.cumsum(b_s)))          # max_t (t + W'(S_t))
  w_all = float(k[-1] * a + b * b_s.sum())
  forward, backward = prob.forward_s, prob.backward_s
  update = float(prob.row_update_s[sent].sum()) / prob.network.workers
  if prob.overlap:
    rs = max(thr, _makespan_per_dtype(r_s, b_s, d_s, nd, a, b))
  else:
    rs = max(backward + w_all, thr)
  if not prob.cross_step:
    if prob.overlap:
      return float(max(backward, rs) + max(w_all, update + a) + forward)
    return float(rs + update + w_all + forward)
  ftail = prob.layer_fwd_tail_s
  bound = backward + forward
  zero = ~sent
  if zero.any():
    bound = max(bound, float(np.max(ready[zero] + ftail[layer[zero]])))
  if not prob.overlap:
    return float(max(bound, rs + w_all + forward))
  q_row = ftail[layer[idx]]
  by_q = np.lexsort((idx, -q_row))                                 # ftail descending, then row order
  q_s, bq_s, dq_s = q_row[by_q], nbytes[idx][by_q], dtype[idx][by_q]
  bound = max(bound, rs + _gather_chain(bq_s, q_s, a, b))
  if nd > 1:
    for d in range(nd):
      sel = dq_s == d
      if sel.any():
        bound = max(bound, rs + _gather_chain(bq_s[sel], q_s[sel], a, b))
  return float(bound)


def _gather_chain(nbytes: np.ndarray, tail: np.ndarray, a: float, b: float) -> float:
  """H: the least max over groups of (group end + its largest tail) over contiguous partitions of the
  rows in the given order (tails non-increasing), messages back to back from time 0, each a + b x its
  bytes. Reverse program: h[i] = min_j max(a + b·bytes(i..j) + tail_i, a + b·bytes(i..j) + h[j+1])."""
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

  sent = nbytes > 0

  def work(bytes_, k):  # W for arrays of (bytes, dtype count)
    if deferred:
      bytes_ = np.maximum(bytes_ - deferred, 0.0)
    return np.maximum(a * np.ceil(k / links), (k * a + b * bytes_) / links)

  # rows sorted by ready time, latest first: prefix sums over this order are the sets S_t.
  idx = np.flatnonzero(sent)
  order = idx[np.argsort(-ready[idx], kind="stable")]
  r_s, b_s, d_s, l_s = ready[order], nbytes[order], dtype[order], layer[order]
  n = order.size
  nd = int(dtype.max()) + 1

  def thr_max(mask: np.ndarray) -> np.ndarray:
    """max_t (t + W(R ∩ S_t)) for each row of `mask` (sets R as boolean masks over `order`).

    Evaluated at every position of the sorted order; at ties only part of S_t is counted there, which
    gives a smaller (still valid) value than the full set at the same t, counted at the last tie.
    """
    cb = np.cumsum(np.where(mask, b_s, 0.0), axis=-1)
    k = np.zeros(mask.shape)
    for d in range(nd):
      k += np.cumsum(mask & (d_s == d), axis=-1) > 0
    val = np.where(mask, r_s + work(cb, k), -np.inf)
    return val.max(axis=-1)

  if n:
    everything = np.ones((1, n), dtype=bool)
    thr_all = float(thr_max(everything)[0])
    k_all = len({int(d) for d in d_s})
    w_all = float(work(np.float64(b_s.sum()), np.float64(k_all)))
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
  bound = t0 + forward
  zero = ~sent
  if zero.any():
    bound = max(bound, float(np.max(ready[zero] + tail[layer[zero]])))
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
        vals = thr_max(mask[ok]) + mins[ok]
        bound = max(bound, float(vals.max()))
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
        sel = (l_s >= lo) & (l_s <= hi)
        for dt in range(-1 if nd > 1 else 0, nd):
          m = sel if dt < 0 else sel & (d_s == dt)
          if m.any():
            mk = _batched_makespan(r_s[m][::-1], b_s[m][::-1], a, b)
            bound = max(bound, mk + float(tail[l_s[m]].min()))
        # split: the rows of J ready no earlier than every row outside J ("hold")
        in_j = (l_s >= lo) & (l_s <= hi)
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
  """The layer ranges [lo, hi] that get the batching term: every range on small profiles; else the
  whole model and up to `_BATCH_PREFIXES` evenly spaced prefixes (each costs O(rows))."""
  if nl * (nl + 1) // 2 * n <= _BATCH_WORK:
    return [(lo, hi) for lo in range(nl) for hi in range(lo, nl)]
  ends = np.unique(np.linspace(0, nl - 1, min(nl, _BATCH_PREFIXES)).round().astype(int))
  return [(0, int(e)) for e in ends]


def _makespan_per_dtype(r_s: np.ndarray, b_s: np.ndarray, d_s: np.ndarray, nd: int, a: float, b: float
                        ) -> float:
  """M over every row, and over the rows of each of the `nd` dtypes alone (one chunk holds one dtype),
  the largest: rows given latest first (`r_s` ready times, `b_s` bytes, `d_s` dtype codes)."""
  m = _batched_makespan(r_s[::-1], b_s[::-1], a, b)
  if nd > 1:
    for d in range(nd):
      sel = (d_s == d)[::-1]
      if sel.any():
        m = max(m, _batched_makespan(r_s[::-1][sel], b_s[::-1][sel], a, b))
  return m


def _batched_makespan(ready: np.ndarray, nbytes: np.ndarray, a: float, b: float) -> float:
  """M: the least one-link end of the last chunk over contiguous merges of rows in ready order."""
  return float(_batched_ends(ready, nbytes, a, b)[-1])


def _batched_ends(ready: np.ndarray, nbytes: np.ndarray, a: float, b: float) -> np.ndarray:
  """min over contiguous partitions of rows sorted by ready time (ascending) of the one-link end of
  the last chunk.

  F[0] = 0; F[e+1] = min over s <= e of max(F[s], r_e) + a + b (P[e+1] - P[s]) (the last chunk holds
  rows s..e; P the prefix sums of bytes). F is nondecreasing, so the s with F[s] <= r_e form a prefix
  [0, k): among them s = k-1 is best; for s in [k, e] the value is F[s] - b P[s] + a + b P[e+1],
  whose minimum over a window with nondecreasing ends a monotone deque keeps: O(n) in all.
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
  """The split lemma's bound (see `lower_bound`): rows `hold` (ascending ready, every one ready no
  earlier than any of the `other` rows, also ascending) and the tails."""
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
  """Optimal preemptive max(C_i + q_i) on one machine, releases r_i, processing p_i (Jackson's rule:
  at every moment run the released job with the largest q; optimal for 1|r_j,pmtn|L_max)."""
  order = np.argsort(release, kind="stable")
  rel, wk, q = release[order].tolist(), work[order].tolist(), delivery[order].tolist()
  n = len(rel)
  heap: list[tuple[float, int]] = []
  remaining = list(wk)
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
