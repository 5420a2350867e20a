"""B_fsdp: a lower bound on the simulated iteration of every FSDP / HSDP schedule (pure numpy; the claim
and its proof: docs/fsdp.md, "B_fsdp and its proof").
"""

from __future__ import annotations

import numpy as np

from ._core import Problem
from ._fsdp import gather_nbytes, unit_costs

# Forward blocks whose start-ups B4 counts exactly; past it each block is charged this many (a relaxation).
_BLOCKS = 16
# F'' compares every pair of sharded layers (n x n arrays per block count): past this many sharded layers
# B4 uses F' instead (F'' >= F', so the bound stays valid, only less tight).
_BLOCK_LAYERS = 2048


def fsdp_bound(prob: Problem, micro_batches: int = 1) -> float:
  """B_fsdp for `prob`, whose profile carries its placement, for steps of `micro_batches` micro-batches
  (each as profiled; docs/fsdp.md, "Accumulation"); ValueError without sharded rows or when the mesh does
  not hold network.workers devices.
  """
  profile = prob.profile
  s, r = profile.shard_count, profile.replica_count
  if not profile.sharded or s * r != prob.network.workers:
    raise ValueError(f"lower_bound(sharded='fsdp'): the profile must carry a placement with sharded rows on a "
                     f"mesh of network.workers={prob.network.workers} devices (it has mesh "
                     f"{dict(profile.mesh)}); see GradientProfile.from_params(shardings=, mesh=).")
  a_g, b_g, a_r, b_r, a_a, b_a = unit_costs(prob, s, r)
  nl = len(prob.layers)
  sharded = np.fromiter((row.shard_dim is not None for row in profile.rows), dtype=bool, count=len(profile.rows))
  nb = prob.row_nbytes
  s_l = np.zeros(nl)                          # reduce-scattered bytes per layer; g_l: gathered (gather dtype)
  g_l = np.zeros(nl)
  r_l = np.zeros(nl)
  np.add.at(s_l, prob.row_layer[sharded], nb[sharded])
  np.add.at(g_l, prob.row_layer[sharded], np.asarray(gather_nbytes(profile))[sharded])
  np.add.at(r_l, prob.row_layer[~sharded], nb[~sharded])
  ready_l = np.zeros(nl)
  np.maximum.at(ready_l, prob.row_layer, prob.row_ready_s)
  fwd = prob.layer_fwd_s
  upd = prob.row_update_s
  update = float(upd[sharded].sum()) / s + float(upd[~sharded].sum())
  has_s = s_l > 0
  sigma_s, sigma_r = float(s_l.sum()), float(r_l.sum())
  link0 = 2 * a_g + b_g * (sigma_s + float(g_l.sum())) + (a_a + b_a * sigma_r if r == 1 and sigma_r > 0 else 0.0)
  link1 = 0.0
  if r > 1:
    link1 = a_r + b_r * sigma_s + (a_a + b_a * sigma_r if sigma_r > 0 else 0.0)
  compute = prob.forward_s + prob.backward_s
  more = (micro_batches - 1) * compute       # the micro-batches between the first's forward and the last's backward
  if not prob.overlap:                       # (+ the slowest worker's waits, `_fsdp.skew_wait`)
    return compute + more + update + link0 + link1 + prob.skew * (compute + update)
  # forward: layer l starts after every sharded byte of layers 0..l has been gathered on link 0
  cum_s = np.cumsum(g_l)
  t = 0.0
  for l in range(nl):
    if has_s[l]:
      t = max(t, a_g + b_g * float(cum_s[l]))
    t += float(fwd[l])
  f_end = t
  # backward: what is ready at >= R(l) is sent after f_end + R(l), one collective at a time per link
  order = np.argsort(-ready_l, kind="stable")
  s_ge = np.cumsum(s_l[order])
  r_ge = np.cumsum(r_l[order])
  rl = ready_l[order]
  w0 = np.where(s_ge > 0, a_g + b_g * s_ge, 0.0)
  w1 = np.zeros(nl)
  if r == 1:
    w0 = w0 + np.where(r_ge > 0, a_a + b_a * r_ge, 0.0)
  else:
    w0 = w0 + np.where(s_ge > 0, a_r, 0.0)          # the last reduce-scatter's shard all-reduce follows it
    w1 = np.where(s_ge > 0, a_r + b_r * s_ge, 0.0) + np.where(r_ge > 0, a_a + b_a * r_ge, 0.0)
  back = max(prob.backward_s, float(np.max(rl + np.maximum(w0, w1))) if nl else 0.0)
  if has_s.any():
    tail_s = a_g + b_g * s_l[has_s] + ((a_r + b_r * s_l[has_s]) if r > 1 else 0.0)
    back = max(back, float(np.max(ready_l[has_s] + tail_s)))
  b1 = f_end + back + update + more
  b4 = f_end
  if has_s.any():                      # B4: every unit's start-up, in forward and in backward
    f_blocks = f_end
    if int(has_s.sum()) <= _BLOCK_LAYERS:
      f_blocks = max(forward_blocks(g_l, np.asarray(fwd, dtype=float), a_g, b_g)[0], f_end)
    pos = np.lexsort((-np.arange(nl), ready_l))
    pos = pos[has_s[pos]]
    e = backward_chain(ready_l[pos], s_l[pos], a_g, b_g)[0] + (a_r if r > 1 else 0.0)
    b4 = f_blocks + max(back, e) + update + more
  return max(b1, b4, link0 + update, link1 + update)


def forward_blocks(s_l: np.ndarray, fwd: np.ndarray, a: float, b: float, ends: np.ndarray | None = None
                   ) -> tuple[float, list[int]]:
  """F'' and the blocks of its least partition (fewer than _BLOCKS blocks): the layer each block ends at.

  `ends` restricts where a block may end (the sharded layers' ranks, ascending, the last included); the
  value is then that restricted partition's forward end, no longer F''.
  """
  nl = len(s_l)
  sh = np.flatnonzero(s_l > 0)
  e = np.arange(len(sh)) if ends is None else np.asarray(ends, dtype=np.int64)
  n = len(e)
  fpre = np.concatenate([[0.0], np.cumsum(fwd)])          # forward of the layers before x
  cum = np.cumsum(s_l)[sh][e]
  starts = np.concatenate([[0], e[:-1] + 1])               # block i.. starts at sharded rank starts[i]
  lo = fpre[sh[starts]]
  hi = fpre[np.append(sh[1:], nl)[e]]                      # after a block ending at e[j]: layers to here
  upper = np.triu(np.ones((n, n), dtype=bool))             # a block starts[i]..e[j] needs i <= j
  state = np.full(n + 1, np.inf)                           # state[i]: forward done up to layer sh[starts[i]]
  state[0] = fpre[sh[0]]
  best, best_k, back = np.inf, 0, []
  cols = np.arange(n)
  for k in range(1, _BLOCKS):
    gate = k * a + b * cum
    m = np.where(upper, np.maximum(state[:n, None], gate[None, :]) - lo[:, None] + hi[None, :], np.inf)
    arg = m.argmin(axis=0)
    back.append(arg)
    nxt_state = np.full(n + 1, np.inf)
    nxt_state[1:] = m[arg, cols]
    if nxt_state[n] < best:                                # exactly k blocks
      best, best_k = float(nxt_state[n]), k
    state = nxt_state
    if not np.isfinite(state[:n]).any():
      break
  blocks, j = [], n - 1
  for k in range(best_k, 0, -1):
    blocks.append(int(sh[e[j]]))
    j = int(back[k - 1][j]) - 1
  blocks.reverse()
  if ends is not None or not np.isfinite(state[:n]).any():
    return best, blocks
  # block _BLOCKS onwards, each charged _BLOCKS start-ups: single layers are then best (a layer's gate
  # only grows with its block), so from state i the end is the chain over the layers left
  tail = _BLOCKS * a + b * cum + (fpre[nl] - lo)
  suffix = np.maximum.accumulate(tail[::-1])[::-1]
  return min(best, float(np.maximum(state[:n] + fpre[nl] - lo, suffix).min())), blocks


def backward_chain(ready: np.ndarray, nbytes: np.ndarray, a: float, b: float,
                   ends: np.ndarray | None = None, second: tuple[float, float] | None = None
                   ) -> tuple[float, list[int]]:
  """E'' and the positions its least partition's blocks end at (ascending; `ready` nondecreasing).

  `ends` restricts where a block may end; `second` (a2, b2) charges each block its slower stage on a
  second link (HSDP's replica all-reduce): a planner's heuristic, no longer a bound.
  """
  m = len(ready)
  e_at = np.arange(m) if ends is None else np.asarray(ends, dtype=np.int64)
  cum = np.concatenate([[0.0], np.cumsum(nbytes)])[np.concatenate([[0], e_at + 1])]
  rdy = np.asarray(ready)[e_at]
  n = len(e_at)
  e = np.empty(n + 1)
  e[0] = 0.0
  arg = [0] * (n + 1)
  for j in range(1, n + 1):
    g = cum[j] - cum[:j]
    cost = a + b * g if second is None else np.maximum(a + b * g, second[0] + second[1] * g)
    v = np.maximum(e[:j], rdy[j - 1]) + cost
    i = int(v.argmin())
    e[j], arg[j] = v[i], i
  blocks, j = [], n
  while j > 0:
    blocks.append(int(e_at[j - 1]))
    j = arg[j]
  blocks.reverse()
  return float(e[n]), blocks
