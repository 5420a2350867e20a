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

and with overlap=False iteration >= F + B + U' + (B2 - U') + (B3 - U').

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
the compute plus every collective's time, each bounded as in B2 and B3. The pipelined step is simulated
as the plain step (`_fsdp`), so the same bound holds. []
"""

from __future__ import annotations

import numpy as np

from ._core import Problem
from ._fsdp import unit_costs

__all__ = ["fsdp_bound"]


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
  if not prob.overlap:
    return compute + update + link0 + link1
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
  return max(b1, link0 + update, link1 + update)
