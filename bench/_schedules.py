"""A Schedule from groups of element slices, built with the public values (`prophet_jax.Schedule`,
`Bucket`, `Chunk`) the way every policy builds its own: one Bucket per group, one Chunk (one
all-reduce) per dtype in order of each dtype's first slice, empty slices and groups dropped.

For the benches that plan by a rule of their own (a historical bucketing, an oracle's block rule).
"""

from __future__ import annotations

import prophet_jax as pj


def schedule_of(profile: pj.GradientProfile, groups, *, policy: str, cross_step: bool = False) -> pj.Schedule:
  """The Schedule of `groups` (each an ordered sequence of (row, start, stop) slices) for `profile`."""
  buckets = []
  for group in groups:
    by_dtype: dict[str, list] = {}
    for r, a, b in group:
      if b > a:
        by_dtype.setdefault(profile.rows[r].dtype, []).append((r, a, b))
    if by_dtype:
      buckets.append(pj.Bucket(chunks=tuple(pj.Chunk(slices=tuple(s), dtype=d) for d, s in by_dtype.items())))
  return pj.Schedule(buckets=tuple(buckets), rows=profile.tree_rows(), policy=policy, cross_step=cross_step)
