"""The timeline of FSDP (ZeRO-3) and HSDP schedules and their per-device memory peak (pure numpy; the
model: docs/fsdp.md, "Simulator and bound").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ._core import Problem, sampled_durations
from .._values._tree import IdentityMemo
from .._values._types import itemsize

Slice = tuple[int, int, int]


class FsdpArrays(NamedTuple):
  """An FSDP schedule as the sweep reads it: "units" are the all-gather groups in forward order, `rs_bytes`
  one per reduce-scatter unit, `order` the chunk issue order as ('u', unit) / ('r', replicated) pairs.
  """

  unit_layers: tuple[tuple[int, ...], ...]
  first: tuple[int, ...]
  unit_bytes: tuple[float, ...]
  keep: tuple[bool, ...]
  prefetch: int
  backward_prefetch: int
  rep_bytes: tuple[float, ...]
  order: tuple[tuple[str, int], ...]
  chunk_ready_pos: tuple[int, ...]          # per issued chunk (order), the backward position it waits for
  ends_at: Sequence[Sequence[int]]          # per backward position, the units whose backward ends there
  bwd_layers: tuple[int, ...]
  bwd_dur: tuple[float, ...]
  bwd_tail: float
  unit_bwd_first: tuple[int, ...]           # per unit: backward position of its first / last layer
  unit_bwd_last: tuple[int, ...]
  bwd_units: tuple[int, ...]                # the units in backward order
  update_s: float
  shards: int
  replicas: int
  rs_bytes: tuple[float, ...] = ()
  rs_at: Sequence[Sequence[int]] = ()     # per backward position, the units whose gradient is made there
  reads: tuple[bool, ...] = ()            # per group: does backward read it (not: the first layer's alone)
  one_slot: bool = False                  # HSDP at one collective in flight: the replica all-reduces on link 0
  held: tuple[bool, ...] = ()             # per group: gathered once, held across the micro-batches
  rs_held: tuple[bool, ...] = ()          # per unit: whole gradient held, reduce-scattered once


class FsdpForward(NamedTuple):
  """Where a step stands when forward ends: the same for every keep pattern and backward prefetch."""

  t_link: float
  t_dev: float
  comm: float
  ag_end: list[float]
  fwd_end: list[float]
  mem_t: list[float]
  mem_d: list[float]
  ag_start: list[float]


class FsdpRun(NamedTuple):
  """One simulated FSDP step: the iteration, the memory peak, the link busy time, the spans (kind,
  name, start, end, lane) when asked for, and its forward (for `fsdp_run(forward=)`)."""

  iteration_s: float
  peak_memory_bytes: float
  comm_s: float
  spans: list[tuple[str, str, float, float, str]]
  forward: FsdpForward | None = None


class BackwardOrder(NamedTuple):
  """A profile's layers in backward (ready) order with their times and positions, read by every FSDP
  schedule of it.
  """

  layers: tuple[int, ...]
  dur: tuple[float, ...]
  tail: float
  row_pos: tuple[int, ...]
  layer_pos: tuple[int, ...]
  ready: tuple[float, ...]


def backward_order(prob: Problem) -> BackwardOrder:
  """The BackwardOrder of `prob` (ready order; ties: later layers first)."""
  nl = len(prob.layers)
  ready_l = np.zeros(nl)
  np.maximum.at(ready_l, prob.row_layer, prob.row_ready_s)
  bwd = np.lexsort((-np.arange(nl), ready_l))
  r_sorted = ready_l[bwd]
  pos = np.empty(nl, np.int64)
  pos[bwd] = np.arange(nl)
  return BackwardOrder(tuple(bwd.tolist()), tuple(np.diff(r_sorted, prepend=0.0).tolist()),
                       max(float(prob.backward_s) - (float(r_sorted[-1]) if nl else 0.0), 0.0),
                       tuple(pos[prob.row_layer].tolist()), tuple(pos.tolist()), tuple(ready_l.tolist()))


@IdentityMemo(16)
def gather_nbytes(profile: Any) -> list[float]:
  """Per row, its bytes as all-gathered (`ProfileRow.gather_nbytes`)."""
  return [float(r.gather_nbytes) for r in profile.rows]


def fsdp_arrays(prob: Problem, chunks: Sequence[Sequence[Slice]], units: Sequence[int], keep: Sequence[bool],
                prefetch: int, backward_prefetch: int, shards: int, replicas: int,
                gathers: Sequence[Sequence[int]] | None = None, *, order_of: BackwardOrder | None = None,
                gathered: Sequence[float] | None = None, in_flight: int | None = None) -> FsdpArrays:
  """The FsdpArrays of a schedule's chunks and its FSDP plan.

  Args:
    prob: the Problem.
    chunks: the chunks' slices, issue order.
    units: the reduce-scatter chunks (indices into `chunks`).
    keep: one per all-gather group.
    gathers: the all-gather groups (rows, forward order); None: each unit's rows.
    order_of: the profile's `backward_order`, when the caller has it.
    gathered: per row, its bytes as all-gathered; None: the profile's (`gather_nbytes`).
    in_flight: the plan's; 1: one collective in flight, so HSDP's replica all-reduces queue on link 0.

  Raises:
    ValueError: the all-gather groups are not in forward order.
  """
  layer = prob.row_layer.tolist()
  nbytes = prob.row_nbytes.tolist()
  gb = gather_nbytes(prob.profile) if gathered is None else gathered
  size = prob.size
  nl = len(prob.layers)
  bo = order_of if order_of is not None else backward_order(prob)
  row_pos = bo.row_pos
  unit_of = {int(c): u for u, c in enumerate(units)}
  rep_bytes, order, ready_pos = [], [], []
  rs_bytes = [0.0] * len(units)
  rs_at: list[list[int]] = [[] for _ in range(nl)]
  sharded_rows: list[int] = []
  unit_rows: list[list[int]] = [[] for _ in units]
  unit_pos: list[list[int]] = [[] for _ in units]
  for k, c in enumerate(chunks):
    u = unit_of.get(k)
    if u is None:
      rp = max([row_pos[r] for r, _, _ in c])
      order.append(("r", len(rep_bytes)))
      rep_bytes.append(sum(nbytes[r] * (hi - lo) / size[r] for r, lo, hi in c if size[r]))
    else:
      rows = unit_rows[u] = [r for r, _, _ in c]
      ps = unit_pos[u] = [row_pos[r] for r in rows]
      rp = max(ps)
      order.append(("u", u))
      rs_bytes[u] = float(sum([nbytes[r] for r in rows]))
      rs_at[min(ps)].append(u)          # its gradient buffer: from the start of its first backward layer
      sharded_rows.extend(rows)
    ready_pos.append(rp)
  ul: list[tuple[int, ...]] = []
  ub: list[float] = []
  bf: list[int] = []
  bl: list[int] = []
  for rows in unit_rows if gathers is None else gathers:    # None: each unit's rows, gathered whole
    ub.append(float(sum([gb[r] for r in rows])))
    ps = [row_pos[r] for r in rows]
    bf.append(min(ps))
    bl.append(max(ps))
  gathers = unit_rows if gathers is None else gathers
  n_u = len(gathers)
  for rows in gathers:
    ul.append(tuple(sorted({layer[r] for r in rows})) if len(rows) > 1 else (layer[rows[0]],))
  ends_at: list[list[int]] = [[] for _ in range(nl)]
  for u, k in enumerate(bl):
    ends_at[k].append(u)
  first = [ls[0] for ls in ul]
  reads = tuple(ls != (0,) for ls in ul)   # the profile's first layer reads no weight in backward (its input is the batch)
  for u in range(1, n_u):
    if first[u] < first[u - 1]:
      raise ValueError(f"FSDP units must be in forward order: unit {u} starts at layer "
                       f"{prob.layers[first[u]]!r}, before unit {u - 1}'s first layer "
                       f"{prob.layers[first[u - 1]]!r}.")
  upd = prob.row_update_s
  up_sh = float(upd[sharded_rows].sum()) if sharded_rows else 0.0
  update_s = up_sh / shards + float(upd.sum()) - up_sh
  return FsdpArrays(tuple(ul), tuple(first), tuple(ub), tuple(bool(x) for x in keep), int(prefetch),
                    int(backward_prefetch), tuple(rep_bytes), tuple(order), tuple(ready_pos),
                    ends_at, bo.layers, bo.dur, bo.tail, tuple(bf), tuple(bl),
                    tuple(sorted(range(n_u), key=lambda u: bf[u])), update_s, int(shards), int(replicas),
                    tuple(rs_bytes), rs_at, reads, one_slot=in_flight == 1 and replicas > 1)


def unit_costs(prob: Problem, shards: int, replicas: int) -> tuple[float, float, float, float, float, float]:
  """(a, b) of a unit's gather or reduce-scatter (link 0), of a shard's replica all-reduce (per unit byte,
  link 1) and of a replicated chunk's all-reduce: six numbers.
  """
  net = prob.network
  s, r = shards, replicas
  p = s * r
  a0, b0 = net.link_costs(s)
  a1, b1 = net.link_costs(p)
  ag = ((s - 1) * a0, (s - 1) / s * b0)
  rep = (2 * (r - 1) * a1, 2 * (r - 1) / r * b1 / s) if r > 1 else (0.0, 0.0)
  ar = (2 * (p - 1) * a1, 2 * (p - 1) / p * b1) if p > 1 else (0.0, 0.0)
  return ag + rep + ar


def fsdp_run(prob: Problem, arr: FsdpArrays, *, spans: bool = False, forward: FsdpForward | None = None,
             durations: np.ndarray | None = None, micro: tuple[bool, bool] | None = None) -> FsdpRun:
  """The step's timeline: calm, or with `durations` one sample's collective durations; `forward` reuses a
  calm run's forward (ignored with `spans` or `durations`); `micro` (first, last): one micro-batch of an
  accumulating step, without the memory of what it holds (`_fsdp_accum.accum_run`).
  """
  a_g, b_g, a_r, b_r, a_a, b_a = unit_costs(prob, arr.shards, arr.replicas)
  ag_d = reg_d = rs_d = r1_d = rep_d = None
  if durations is not None:
    ag_d, reg_d, rs_d, r1_d, rep_d = _by_kind(arr, durations.tolist())
    forward = None
  serial = not prob.overlap
  two = arr.replicas > 1
  fwd = prob.layer_fwd_s
  nl = len(fwd)
  n_u = len(arr.first)
  d = arr.prefetch
  out: list[tuple[str, str, float, float, str]] = []
  mem_t: list[float] = []                  # memory events: when, and the bytes allocated (+) or freed (-)
  mem_d: list[float] = []
  ag_end = [0.0] * n_u
  ag_start = [0.0] * n_u
  need = [0.0] * nl
  fwd_start = [0.0] * nl
  t_link = 0.0
  t_dev = 0.0
  nxt = 0
  comm = 0.0
  issue = 0.0
  unit_bytes, unit_layers, first = arr.unit_bytes, arr.unit_layers, arr.first  # (the loops' hot reads)
  held = arr.held if micro is not None and arr.held else (False,) * n_u
  rs_held = arr.rs_held if micro is not None and arr.rs_held else (False,) * len(arr.rs_bytes)
  if micro is not None:
    forward = None

  def run_forward(last: int) -> None:      # the device runs forward through layer `last`
    nonlocal t_dev, nxt
    while nxt <= last:
      nd = need[nxt]
      s = t_dev if t_dev >= nd else nd
      fwd_start[nxt] = s
      t_dev = s + fwd[nxt]
      if spans:
        out.append(("forward", prob.layers[nxt], s, t_dev, "device"))
      nxt += 1

  def gather(u: int, at: float, needs: list[float], again: bool) -> None:
    """Unit u's all-gather on link 0, issued at `at` (`again`: a backward re-gather)."""
    nonlocal t_link, t_dev, comm
    nb = unit_bytes[u]
    if held[u] and not micro[0]:            # gathered by the first micro-batch
      return
    dur = a_g + b_g * nb if ag_d is None else (reg_d[u] if again else ag_d[u])
    s = at if at >= t_link else t_link
    if serial and t_dev > s:
      s = t_dev
    t_link = s + dur
    if serial:
      t_dev = t_link
    comm += dur
    mem_t.append(s)
    mem_d.append(0.0 if held[u] else nb)    # a held group's memory: held for the whole step (`_fsdp_accum`)
    if again:                               # its shards' copy (the tie's), held since its forward gather
      mem_t.append(s)
      mem_d.append(-nb / arr.shards)
    for l in unit_layers[u]:
      if t_link > needs[l]:
        needs[l] = t_link
    if spans:
      out.append(("all_gather", f"unit{u}(backward)" if again else f"unit{u}", s, t_link, "link0"))

  if forward is None or spans:
    for u in range(n_u):
      v = u - d
      if v >= 0 and first[v] < first[u]:
        run_forward(first[v])
        issue = fwd_start[first[v]]
      gather(u, issue, need, False)
      ag_end[u] = t_link
      ag_start[u] = mem_t[-1] if mem_t else 0.0
    run_forward(nl - 1)
    fwd_end_layer = [fwd_start[l] + fwd[l] for l in range(nl)]
    forward = FsdpForward(t_link, t_dev, comm, ag_end, fwd_end_layer, mem_t[:], mem_d[:], ag_start)
  else:
    t_link, t_dev, comm, ag_end, fwd_end_layer = forward[:5]
    ag_start = forward.ag_start
    mem_t.extend(forward.mem_t)
    mem_d.extend(forward.mem_d)
  # backward
  bwd_units = arr.bwd_units
  need_b = [0.0] * nl
  reads, keep = arr.reads, tuple(k or h for k, h in zip(arr.keep, held))
  first_ready, regather_at = _regathers(arr, bwd_units, keep)
  for u in bwd_units:
    if keep[u] and reads[u]:
      for l in arr.unit_layers[u]:
        need_b[l] = max(need_b[l], ag_end[u])
  for u in range(n_u):
    if not (keep[u] and reads[u]) and not held[u]:
      mem_t.append(fwd_end_layer[unit_layers[u][-1]])
      mem_d.append(-unit_bytes[u])
      if reads[u]:                          # the shards' copy a re-gather is tied to
        mem_t.append(ag_start[u])
        mem_d.append(unit_bytes[u] / arr.shards)
  pre_t: list[float] = []                   # allocations before the frees at their time (a weight's gradient)
  pre_d: list[float] = []
  link1: list[tuple[float, float, str]] = []
  unit_bwd_end = [0.0] * n_u

  def regather(us: Sequence[int], at: float) -> None:
    for u in us:
      gather(u, at, need_b, True)

  regather(first_ready, t_dev)
  ci = 0
  n_c = len(arr.order)
  last_issue = 0.0
  rs_at, rs_bytes, bwd_dur, ends_at = arr.rs_at, arr.rs_bytes, arr.bwd_dur, arr.ends_at
  ready_pos, order = arr.chunk_ready_pos, arr.order
  for k, l in enumerate(arr.bwd_layers):
    nb = need_b[l]
    s = t_dev if t_dev >= nb else nb
    if serial and t_link > s:
      s = t_link
    if k in regather_at:
      regather(regather_at[k], s)
      if serial and t_dev > s:
        s = t_dev
    t_dev = s + bwd_dur[k]
    if spans:
      out.append(("backward", prob.layers[l], s, t_dev, "device"))
    for x in rs_at[k]:                            # a unit's gradient buffer, made while its weights are held
      pre_t.append(t_dev)
      pre_d.append(rs_bytes[x])
    for u in ends_at[k]:
      unit_bwd_end[u] = t_dev
    while ci < n_c and ready_pos[ci] <= k:
      kind, x = order[ci]
      if t_dev > last_issue:
        last_issue = t_dev
      if kind == "u" and rs_held[x] and not micro[1]:    # added to its held sum; scattered by the last micro-batch
        mem_t.append(last_issue)
        mem_d.append(-rs_bytes[x])
      elif kind == "u":
        dur = a_g + b_g * rs_bytes[x] if rs_d is None else rs_d[x]
        st = last_issue if last_issue >= t_link else t_link
        if serial and t_dev > st:
          st = t_dev
        t_link = st + dur
        comm += dur
        mem_t.append(t_link)                      # the gradient buffer, reduced
        mem_d.append(-rs_bytes[x])
        if spans:
          out.append(("reduce_scatter", f"unit{x}", st, t_link, "link0"))
        dur1 = a_r + b_r * arr.rs_bytes[x] if r1_d is None else r1_d[x]
        if arr.one_slot:                          # the shard's replica all-reduce right after it, one in flight
          st = t_dev if serial and t_dev > t_link else t_link
          t_link = st + dur1
          comm += dur1
          if spans:
            out.append(("allreduce", f"unit{x}", st, t_link, "link0"))
        elif two:
          link1.append((t_link, dur1, f"unit{x}"))
      else:
        dur = a_a + b_a * arr.rep_bytes[x] if rep_d is None else rep_d[x]
        if two and not arr.one_slot:
          link1.append((last_issue, dur, f"replicated{x}"))
        else:
          st = max(last_issue, t_link, t_dev) if serial else max(last_issue, t_link)
          t_link = st + dur
          comm += dur
          if spans:
            out.append(("allreduce", f"replicated{x}", st, t_link, "link0"))
      if serial:
        t_dev = max(t_dev, t_link)
      ci += 1
  for u in range(n_u):
    if reads[u] and not held[u]:
      mem_t.append(unit_bwd_end[u])                # the parameters kept or gathered again
      mem_d.append(-unit_bytes[u])
  t_dev += arr.bwd_tail
  t1 = 0.0
  for at, dur, name in sorted(link1, key=lambda x: x[0]):
    s = max(at, t1, t_dev) if serial else max(at, t1)
    t1 = s + dur
    if serial:
      t_dev = t1
    comm += dur
    if spans:
      out.append(("allreduce", name, s, t1, "link1"))
  end = float(max(t_dev, t_link, t1))
  iteration = end + arr.update_s + skew_wait(prob, arr)
  if spans and arr.update_s > 0:
    out.append(("update", "update", end, iteration, "device"))
  peak = 0.0
  if mem_t:
    t = np.array(mem_t + pre_t, dtype=np.float64)
    dlt = np.array(mem_d + pre_d, dtype=np.float64)
    rank = np.concatenate([dlt[:len(mem_t)], np.full(len(pre_t), -np.inf)])   # frees first, but `pre` before them
    peak = float(np.cumsum(dlt[np.lexsort((rank, t))]).max())
  return FsdpRun(float(iteration), max(peak, 0.0), float(comm), out, forward)


def _regathers(arr: FsdpArrays, bwd_units: Sequence[int], keep: Sequence[bool] | None = None
               ) -> tuple[list[int], dict[int, list[int]]]:
  """The units re-gathered when backward starts, and per backward position those issued there."""
  db, keep = arr.backward_prefetch, arr.keep if keep is None else keep
  first_ready: list[int] = []
  at: dict[int, list[int]] = {}
  for j, u in enumerate(bwd_units):
    if not keep[u] and arr.reads[u]:
      if j < db:
        first_ready.append(u)
      else:
        at.setdefault(arr.unit_bwd_first[bwd_units[j - db]], []).append(u)
  return first_ready, at


def skew_wait(prob: Problem, arr: FsdpArrays) -> float:
  """The slowest worker's cost to a step without overlap: skew x (forward + backward + update); 0 with
  overlap or no skew.
  """
  return prob.skew * (prob.forward_s + prob.backward_s + arr.update_s) if prob.skew else 0.0


def fsdp_samples(prob: Problem, arr: FsdpArrays, durations: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Every sample's iteration and link time, all samples at once (bit for bit the per-sample runs); no
  spans, no memory.
  """
  dur = np.asarray(durations, dtype=np.float64).T         # [messages, samples]: a row per collective
  ag_d, reg_d, rs_d, r1_d, rep_d = _by_kind(arr, dur)
  serial, two = not prob.overlap, arr.replicas > 1
  mx = np.maximum
  fwd, nl, n_u, d = prob.layer_fwd_s, len(prob.layer_fwd_s), len(arr.first), arr.prefetch
  zero = np.zeros(dur.shape[1])
  need: list = [0.0] * nl
  fwd_start: list = [zero] * nl
  ag_end: list = [zero] * n_u
  st = {"link": zero, "dev": zero, "comm": zero}          # link 0 and the device free from; link time

  def run_forward(frm: int, last: int) -> None:
    for l in range(frm, last + 1):
      fwd_start[l] = s = mx(st["dev"], need[l])
      st["dev"] = s + fwd[l]

  def gather(u: int, at, needs: list, dur_u) -> None:
    s = mx(at, st["link"])
    if serial:
      s = mx(s, st["dev"])
    st["link"] = s + dur_u
    if serial:
      st["dev"] = st["link"]
    st["comm"] = st["comm"] + dur_u
    for l in arr.unit_layers[u]:
      needs[l] = mx(needs[l], st["link"])

  done, issue = 0, zero
  for u in range(n_u):
    v = u - d
    if v >= 0 and arr.first[v] < arr.first[u]:
      run_forward(done, arr.first[v])
      done, issue = max(done, arr.first[v] + 1), fwd_start[arr.first[v]]
    gather(u, issue, need, ag_d[u])
    ag_end[u] = st["link"]
  run_forward(done, nl - 1)
  bwd_units = arr.bwd_units
  need_b: list = [0.0] * nl
  first_ready, regather_at = _regathers(arr, bwd_units)
  for u in bwd_units:
    if arr.keep[u]:
      for l in arr.unit_layers[u]:
        need_b[l] = mx(need_b[l], ag_end[u])
  at0 = st["dev"]
  for u in first_ready:
    gather(u, at0, need_b, reg_d[u])
  link1_at, link1_dur = [], []
  ci, last_issue = 0, zero
  for k, l in enumerate(arr.bwd_layers):
    s = mx(st["dev"], need_b[l])
    if serial:
      s = mx(s, st["link"])
    for u in regather_at.get(k, ()):
      gather(u, s, need_b, reg_d[u])
    if serial and k in regather_at:
      s = mx(s, st["dev"])
    st["dev"] = s + arr.bwd_dur[k]
    while ci < len(arr.order) and arr.chunk_ready_pos[ci] <= k:
      kind, x = arr.order[ci]
      last_issue = mx(last_issue, st["dev"])
      if kind == "u" or not two or arr.one_slot:
        dur_x = rs_d[x] if kind == "u" else rep_d[x]
        s0 = mx(last_issue, st["link"])
        st["link"] = (mx(s0, st["dev"]) if serial else s0) + dur_x
        st["comm"] = st["comm"] + dur_x
        if kind == "u" and arr.one_slot:
          st["link"] = (mx(st["link"], st["dev"]) if serial else st["link"]) + r1_d[x]
          st["comm"] = st["comm"] + r1_d[x]
        elif kind == "u" and two:
          link1_at.append(st["link"])
          link1_dur.append(r1_d[x])
      else:
        link1_at.append(last_issue)
        link1_dur.append(rep_d[x])
      if serial:
        st["dev"] = mx(st["dev"], st["link"])
      ci += 1
  t_dev = st["dev"] + arr.bwd_tail
  t1, comm = zero, st["comm"]
  if link1_at:                                             # first-in first-out by issue time, per sample
    at, du = np.array(link1_at), np.array(link1_dur)
    o = np.argsort(at, axis=0, kind="stable")
    at, du = np.take_along_axis(at, o, 0), np.take_along_axis(du, o, 0)
    for a_j, d_j in zip(at, du):
      s = mx(a_j, t1)
      if serial:
        s = mx(s, t_dev)
      t1 = s + d_j
      if serial:
        t_dev = t1
      comm = comm + d_j
  return mx(mx(t_dev, st["link"]), t1) + (arr.update_s + skew_wait(prob, arr)), comm


def dear_peak_bytes(prob: Problem, rs_ready: np.ndarray, rs_nbytes: np.ndarray, rs_end: np.ndarray) -> float:
  """A `dear` (ZeRO-1) step's memory per device, counted as for FSDP: every parameter whole, plus each
  chunk's unsharded gradient from its ready time to its reduce-scatter's end.
  """
  params = float(prob.row_nbytes.sum())
  if not rs_nbytes.size:
    return params
  t = np.concatenate([rs_ready, rs_end])
  dlt = np.concatenate([rs_nbytes, -rs_nbytes])
  o = np.lexsort((dlt, t))
  return params + max(float(np.cumsum(dlt[o]).max()), 0.0)


def _by_kind(arr: FsdpArrays, d: Any) -> tuple[Any, Any, Any, Any, Any]:
  """`d` cut into forward all-gathers, re-gathers, reduce-scatters, replica and replicated all-reduces."""
  n_g, n_rs = len(arr.first), len(arr.rs_bytes)
  return (d[:n_g], d[n_g:2 * n_g], d[2 * n_g:2 * n_g + n_rs], d[2 * n_g + n_rs:2 * n_g + 2 * n_rs],
          d[2 * n_g + 2 * n_rs:])


def fsdp_durations(prob: Problem, arr: FsdpArrays) -> np.ndarray:
  """Every sample's collective durations under pressure, [samples, messages], in `_by_kind`'s order, each
  with its ring's steps (S-1, 2(R-1) or 2(P-1)).
  """
  a_g, b_g, a_r, b_r, a_a, b_a = unit_costs(prob, arr.shards, arr.replicas)
  s, r = arr.shards, arr.replicas
  n_g, n_rs, n_rep = len(arr.unit_bytes), len(arr.rs_bytes), len(arr.rep_bytes)
  nbytes = np.concatenate([arr.unit_bytes, arr.unit_bytes, arr.rs_bytes, arr.rs_bytes, arr.rep_bytes])
  kinds = np.repeat([0, 1, 2], [2 * n_g + n_rs, n_rs, n_rep])   # the shard ring, replica, all devices
  a = np.array([a_g, a_r, a_a])[kinds]
  b = np.array([b_g, b_r, b_a])[kinds]
  steps = np.array([s - 1, 2 * (r - 1), 2 * (s * r - 1)])[kinds]
  return sampled_durations(prob.network.pressure, a, b, nbytes.astype(np.float64), steps)


def fsdp_arrays_of(prob: Problem, schedule) -> FsdpArrays:
  """The FsdpArrays of a Schedule with `fsdp` on `prob`; ValueError for a mesh not of network.workers
  devices, or several links.
  """
  f = schedule.fsdp
  p = f.shard_count * f.replica_count
  if p != prob.network.workers:
    raise ValueError(f"the FSDP schedule's mesh {dict(f.mesh)} has {p} devices, but network.workers="
                     f"{prob.network.workers}; use network.with_workers({p}).")
  if prob.network.links != 1:
    raise ValueError(f"an FSDP schedule runs its collectives in one issue order per link level, but "
                     f"network.links={prob.network.links}; use network.replace(links=1).")
  cap = f.in_flight or max(f.prefetch, f.backward_prefetch)    # deeper prefetch runs as this deep (FACTS F2)
  gathered = [float(prob.row_nbytes[r] if g is None else prob.size[r] * itemsize(g))
              for r, g in enumerate(f.gather_dtypes or [None] * len(prob.size))]
  return fsdp_arrays(prob, [c.slices for c in schedule.chunks], f.units, f.keep, min(f.prefetch, cap),
                     min(f.backward_prefetch, cap), f.shard_count, f.replica_count, f.gathers or None,
                     gathered=gathered, in_flight=f.in_flight)._replace(held=f.hold_params, rs_held=f.hold_grads)
