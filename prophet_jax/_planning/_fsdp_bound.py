"""B_fsdp: a lower bound on the simulated iteration of every FSDP / HSDP schedule of a profile (pure
numpy). `lower_bound(..., sharded="fsdp")` returns it; `lower_bound(...)` of a sharded profile takes the
minimum with the other families' bounds.

Notation (the model of `_fsdp`): S shards, R replicas, P = S·R; a unit of G bytes is all-gathered or
reduce-scattered in a_g + b_g·G on link 0, its shard all-reduced over the replicas in a_r + b_r·G on
link 1 (R > 1; b_r counts the unit's bytes), a replicated chunk of n bytes all-reduced in a_a + b_a·n
(link 1 when R > 1, else link 0). Σ_s: bytes of the sharded rows, Σ_r: of the replicated rows (both
> 0 rows only). F, B: forward and backward; U' = update of the sharded rows / S + of the replicated
rows. For a layer l: s(l), r(l) its sharded and replicated bytes, pre(l) the forward of the layers
before it, R(l) its latest ready_s.

Claim: every FSDP schedule's simulated iteration is >= max(B1, B2, B3) with (overlap=True)

  B1 = F' + max(B, max_l (R(l) + W(l)), max_l[s(l) > 0] (R(l) + a_g + b_g·s(l) + (a_r + b_r·s(l) if R > 1)))
       + U'
  F' = the forward recurrence t_l = max(t_{l-1} + f(l-1), a_g + b_g·(s(0) + ... + s(l)) if s(l) > 0),
       F' = t_last + f(last)                                         (a layer waits for its rows' gathers)
  W(l) = max(W0(l), W1(l)) over the layers ready at >= R(l), s_ge and r_ge their bytes:
       W0 = (a_g + b_g·s_ge if s_ge > 0) + (a_a + b_a·r_ge if R = 1 and r_ge > 0) + (a_r if R > 1, s_ge > 0)
       W1 = (a_r + b_r·s_ge if R > 1, s_ge > 0) + (a_a + b_a·r_ge if R > 1 and r_ge > 0)
  B2 = 2(a_g + b_g·Σ_s) + (a_a + b_a·Σ_r if R = 1 and Σ_r > 0) + U'                   (link 0's work)
  B3 = (a_r + b_r·Σ_s if R > 1) + (a_a + b_a·Σ_r if R > 1 and Σ_r > 0) + U'            (link 1's work)

and with overlap=False iteration >= F + B + U' + (B2 - U') + (B3 - U') + skew·(F + B + U'). With overlap, also B4 >= B1, which
charges each unit's start-up a_g in forward and in backward (B1 charges one at each end):

  B4 = F'' + max(back(B1), E'' + (a_r if R > 1)) + U'
  F'' = min over partitions of the sharded layers (forward order) into contiguous blocks D_1..D_J of the
       recurrence of F' in which the first layer of block j waits for j·a_g + b_g·(s(0) + ... + s(last
       layer of D_j)) (j charged min(j, K) start-ups, K = `_BLOCKS`: a relaxation past K blocks)
  E'' = min over partitions of the sharded layers in ready order (R nondecreasing) into contiguous
       blocks C_1..C_J of the chain e_j = max(e_{j-1}, R(last layer of C_j)) + a_g + b_g·bytes(C_j), e_0 = 0
  back(B1) = B1 - F' - U' (the max of B and the R(l) + W(l) terms above)

Proof of B4. Forward: let the units' all-gathers be g_1..g_K in link order (forward order), X_k the
bytes of g_1..g_k; gather k ends at >= k·a_g + b_g·X_k (one at a time from 0). For a sharded layer l let
m(l) be the largest index of a unit holding a row of layers 0..l (nondecreasing in l); then every row
of layers 0..l is in g_1..g_m(l), so X_m(l) >= s(0) + ... + s(l). The layers with one value of m form a
contiguous block; its first layer holds a row of unit m (the index rises there), so it starts after
gather m ends, at >= m·a_g + b_g·(s(0) + ... + s(its block's last layer)), and m >= the block's rank j.
So forward ends at >= the recurrence for that partition, >= F''. Backward: let the reduce-scatters be
u_1..u_K in link order (their issue order) and, for a sharded layer at ready position p, q(p) the
least index of a unit holding a row at position >= p (nondecreasing in p). The positions with one
value of q form a contiguous block C_j; unit q holds a row at the block's last position (beyond it q
rises), so it is issued at >= F_end + R(that layer), and units q..K, issued after it and carrying every
row at positions >= the block's first (>= bytes(C_j) + ... + bytes(C_J)), one at a time on link 0, end at
>= F_end + R(last of C_j) + (J - j + 1)·a_g + b_g·(bytes(C_j) + ... + bytes(C_J)) (there are >= J - j + 1
of them: q rises at every later block). The chain e_J unrolls to the max of those terms over j, so the
last reduce-scatter ends at >= F_end + E''; with R > 1 its shard all-reduce follows, >= a_r; the update
follows every collective. back(B1) bounds the same span from F_end, so iteration >= F_end + max(...) + U'
with F_end >= F''. []

Proof. Plain step, overlap=True. (B1) Forward starts at 0 with nothing gathered. Layer l's forward
starts only after every unit holding a row of layers 0..l has been gathered in forward (units are
gathered in forward order, each before its first layer runs); those units carry >= s(0) + ... + s(l)
bytes on link 0, one at a time, each starting at >= 0 and lasting a_g + b_g·G, so the last ends >= a_g
+ b_g·(s(0) + ... + s(l)) (one or more units: the alphas only add). Layers run in order, so forward
ends at >= F'. The collectives holding a row ready at >= R(l) start at >= F' + R(l) (below) and
carry s_ge sharded bytes (reduce-scatters, >= one) and r_ge replicated ones (all-reduces, >= one)
one at a time per link: link 0 ends >= F' + R(l) + W0(l) (with R > 1 the shard all-reduce of the
last reduce-scatter then takes >= a_r), link 1 >= F' + R(l) + W1(l). Backward starts at forward's end
and lasts >= B (waits only add), so it ends at >= F' + B; a row of layer l is produced no earlier
than F' + R(l) (backward runs in ready order, its layers' spans only shifted later), so the reduce-scatters of the units holding layer
l's rows start at >= F' + R(l) and the last of them ends >= F' + R(l) + a_g + b_g·s(l), then (R > 1)
the shard all-reduces, issued at those ends, >= a_r + b_r·s(l) more; likewise the replicated chunks of
layer l, each issued once its rows are ready. The update follows every collective and backward: +U'.
(B2) Link 0 runs one collective at a time within [0, iteration - U']: at least one all-gather and one
reduce-scatter holding every sharded byte (the units partition the sharded rows; more units only add
alphas) and, with R = 1, the replicated all-reduces (>= one, every replicated byte). (B3) the same on
link 1. overlap=False: the device and the links are one serial resource, so the iteration is at least
the compute plus every collective's time, each bounded as in B2 and B3, plus the slowest worker's
waits, which the model charges as exactly skew·(F + B + U') (`_fsdp.skew_wait`). The pipelined step is simulated
as the plain step (`_fsdp`), so the same bound holds. []
"""

from __future__ import annotations

import numpy as np

from ._core import Problem
from ._fsdp import unit_costs

__all__ = ["backward_chain", "forward_blocks", "fsdp_bound"]

# Forward blocks whose start-ups B4 counts exactly; past it each block is charged this many (a relaxation).
_BLOCKS = 16
# F'' compares every pair of sharded layers (n x n arrays per block count): past this many sharded layers
# B4 uses F' instead (F'' >= F', so the bound stays valid, only less tight).
_BLOCK_LAYERS = 2048


def fsdp_bound(prob: Problem) -> float:
  """B_fsdp of the module docstring for `prob`, whose profile carries its placement.

  Raises:
    ValueError: the profile has no sharded rows, or its mesh does not hold network.workers devices.
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
  s_l = np.zeros(nl)
  r_l = np.zeros(nl)
  np.add.at(s_l, prob.row_layer[sharded], nb[sharded])
  np.add.at(r_l, prob.row_layer[~sharded], nb[~sharded])
  ready_l = np.zeros(nl)
  np.maximum.at(ready_l, prob.row_layer, prob.row_ready_s)
  fwd = prob.layer_fwd_s
  upd = prob.row_update_s
  update = float(upd[sharded].sum()) / s + float(upd[~sharded].sum())
  has_s, has_r = s_l > 0, r_l > 0
  sigma_s, sigma_r = float(s_l.sum()), float(r_l.sum())
  link0 = 2 * (a_g + b_g * sigma_s) + (a_a + b_a * sigma_r if r == 1 and sigma_r > 0 else 0.0)
  link1 = 0.0
  if r > 1:
    link1 = a_r + b_r * sigma_s + (a_a + b_a * sigma_r if sigma_r > 0 else 0.0)
  compute = prob.forward_s + prob.backward_s
  if not prob.overlap:                       # (+ the slowest worker's waits, `_fsdp.skew_wait`)
    return compute + update + link0 + link1 + prob.skew * (compute + update)
  # forward: layer l starts after every sharded byte of layers 0..l has been gathered on link 0
  cum_s = np.cumsum(s_l)
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
  b1 = f_end + back + update
  b4 = f_end
  if has_s.any():                      # B4: every unit's start-up, in forward and in backward
    f_blocks = f_end
    if int(has_s.sum()) <= _BLOCK_LAYERS:
      f_blocks = max(forward_blocks(s_l, np.asarray(fwd, dtype=float), a_g, b_g)[0], f_end)
    pos = np.lexsort((-np.arange(nl), ready_l))
    pos = pos[has_s[pos]]
    e = backward_chain(ready_l[pos], s_l[pos], a_g, b_g)[0] + (a_r if r > 1 else 0.0)
    b4 = f_blocks + max(back, e) + update
  return max(b1, b4, link0 + update, link1 + update)


def forward_blocks(s_l: np.ndarray, fwd: np.ndarray, a: float, b: float, ends: np.ndarray | None = None
                   ) -> tuple[float, list[int]]:
  """F'' of the module docstring (the least forward end over contiguous blocks of the sharded layers,
  block j's first layer waiting for min(j, _BLOCKS)·a + b·(the sharded bytes through the block's end)),
  and the blocks of the least partition into fewer than _BLOCKS blocks (counted exactly): the layer
  (index into `s_l`) each block ends at, in forward order. `ends`: the sharded layers' ranks (0 = the
  first sharded layer; ascending, the last one included) a block may end at, for a planner that wants
  the partition fast; then the value is that restricted partition's forward end (no longer F'')."""
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
  """E'' of the module docstring (the least end of the chain over contiguous blocks of the sharded
  layers in ready order (`ready` nondecreasing), e_j = max(e_{j-1}, ready of its last) + a + b·bytes)
  and the blocks of its least partition: the position (index into `ready`) each ends at, ascending.
  `ends`: the positions a block may end at (ascending, the last one included). `second`: (a2, b2) of a
  second link each block crosses after the first (HSDP's replica all-reduce); the chain then charges
  each block its slower stage (a planner's heuristic: the value is no longer a bound)."""
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
