"""Scanned stacks in a profile: a leaf whose leading axis is the layer (scanned by `nn.scan`, `nnx.scan` or
`jax.lax.scan`) planned per layer, and the forward order `from_params` is told (pure; docs/fsdp.md,
"Scanned stacks").
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from ._errors import ProfileError

def unstack_rows(rows: Sequence[Any], stacked: Sequence[str]) -> tuple[Any, ...]:
  """`rows` with every row under a `stacked` prefix split into one row per layer, `<prefix>/<k>/<rest>` of
  layer `<prefix>/<k>` (shape, bytes, update time and sharded dimension per layer), layer by layer at the
  stack's first row; the stack's forward time split evenly, its ready times spread evenly over its span of
  backward (from the latest row ready before it)."""
  rows = list(rows)
  for pre in stacked:
    at = [i for i, r in enumerate(rows) if r.path.startswith(pre + "/")]
    if not at:
      raise ProfileError(f"unstacked: stack {pre!r} names no row (rows like {[r.path for r in rows[:3]]}).")
    members = [rows[i] for i in at]
    n = {r.shape[0] if r.shape else 0 for r in members}
    bad = next((r for r in members if r.shard_dim == 0 or len(n) > 1 or not r.shape or not r.shape[0]), None)
    if bad is not None:
      raise ProfileError(f"unstacked: leaf {bad.path!r} of stack {pre!r} (shape {bad.shape}, shard_dim "
                         f"{bad.shard_dim}): a stack's leaves share their leading (layer) axis, of length >= 1, "
                         f"and are sharded on another dimension.")
    length, end, first = n.pop(), max(r.ready_s for r in members), min(r.ready_s for r in members)
    start = max([r.ready_s for r in rows if r.ready_s <= first and not r.path.startswith(pre + "/")], default=0.0)
    fwd = sum(r.fwd_s for r in members) / length
    per = [dataclasses.replace(
        r, path=f"{pre}/{k}/{r.path[len(pre) + 1:]}", layer=f"{pre}/{k}", shape=r.shape[1:], nbytes=r.nbytes // length,
        ready_s=start + (end - start) * (length - k) / length, fwd_s=fwd if j == 0 else 0.0,
        update_s=r.update_s / length, shard_dim=None if r.shard_dim is None else r.shard_dim - 1)
        for k in range(length) for j, r in enumerate(members)]
    rows = rows[:at[0]] + per + [r for i, r in enumerate(rows) if i > at[0] and i not in set(at)]
  return tuple(rows)


def check_stacks(rows: Sequence[Any], stacks: Any) -> tuple[str, ...]:
  """A profile's `stacks`: prefixes whose rows are all '<prefix>/<k>/...' of layer '<prefix>/<k>'; ProfileError
  naming the prefix otherwise."""
  if isinstance(stacks, str) or not all(isinstance(x, str) and x for x in stacks):
    raise ProfileError(f"the profile has stacks={stacks!r}; expected a list of path prefixes.")
  for pre in stacks:
    under = [r for r in rows if r.path.startswith(pre + "/")]
    if not under or any(not re.fullmatch(re.escape(pre) + r"/\d+", r.layer) for r in under):
      raise ProfileError(f"the profile's stack {pre!r} holds no rows '{pre}/<k>/...' of layer '{pre}/<k>' only "
                         f"(GradientProfile.unstacked makes them).")
  return tuple(stacks)


def in_order(flat: Sequence[Any], specs: Sequence[Any], order: Sequence[str]) -> tuple[list, list]:
  """`flat` ((path, ...) per leaf) and `specs` with the leaves `order` names (paths or path prefixes) first,
  in its order, the others after in flatten order; TypeError for an `order` that is not a list of paths."""
  if isinstance(order, str) or not all(isinstance(o, str) for o in order):
    raise TypeError(f"GradientProfile.from_params(order={order!r}): expected a list of leaf paths or prefixes.")
  at = [next((k for k, o in enumerate(order) if x[0] == o or x[0].startswith(o.rstrip("/") + "/")), len(order))
        for x in flat]
  idx = sorted(range(len(flat)), key=at.__getitem__)
  return [flat[j] for j in idx], [specs[j] for j in idx]
