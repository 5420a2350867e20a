"""The trials of the ZeRO-1 shardability probe (`_zero.shard_mode`) that make global decisions visible.

A transformation that decides something from the whole update (`apply_if_finite`, `skip_not_finite`,
`skip_large_updates` in `MultiSteps(should_skip_update_fn=)`, `clip_by_global_norm`) decides per shard
when it runs on flat shards, and its decision differs from the whole tree's only when a trial puts a
shard on the other side of the decision from the whole. So the probe's gradients are:

- a sweep of scales 1e-6 ... 1e6, one decade apart, over gradients whose magnitude falls by 1e3 along
  each chunk (so the simulated devices' shards hold very different norms: for any threshold in the
  range, some scale puts one device's shard below it while the whole is above);
- one trial at scale 1 with a single NaN in device 1's shard of the first chunk at the second step.

Run per shard without help, such a transformation then differs from the whole and is not 'elementwise';
with the global-norm carrier (a scalar whose square is the rest of the tree's sum of squares: non-finite
as soon as any other shard is) it decides as the whole does, on every device alike: 'global-norm'.

Also here: the extra arguments the probe passes (`value=` for `contrib.reduce_on_plateau`, which the
step forwards too), and the names a refusal gives (the optax factories found in `tx`'s closures).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["SCALES", "gradients", "extra_args", "tx_names"]

SCALES = tuple(10.0 ** k for k in range(-6, 7))


def gradients(rng: np.random.Generator, steps: int, chunk_sizes: list[int], shard: list[int]) -> np.ndarray:
  """(len(SCALES) + 1, steps, total) float32: the swept trials (unscaled; the probe scales them) and
  the NaN trial last."""
  total = sum(chunk_sizes)
  weight = np.concatenate([10.0 ** (-3.0 * np.arange(c) / max(c, 1)) for c in chunk_sizes])
  g = (rng.standard_normal((steps, total)) * weight).astype(np.float32)
  nan = g.copy()
  at = shard[0] if chunk_sizes[0] > shard[0] else 0   # device 1's first element of chunk 0
  nan[min(1, steps - 1), at] = np.nan
  return np.stack([g] * len(SCALES) + [nan])


def scales() -> np.ndarray:
  """The scale of every trial in `gradients`' order (the NaN trial at 1)."""
  return np.asarray(SCALES + (1.0,), np.float32)


def extra_args(names: set[str], step: int) -> dict:
  """Keyword arguments for `tx.update` in the probe: a loss `value` (different each step) for
  transformations that read one (`contrib.reduce_on_plateau`; the step forwards the user's)."""
  return {"value": np.float32(1.0 + 0.5 * ((-1) ** step) + 0.1 * step)} if "reduce_on_plateau" in names else {}


def tx_names(names: set[str]) -> str:
  """The optax factories among the closure names of a transformation, for messages ('sm3, chain')."""
  import optax  # optax is imported already wherever a probe runs; kept out of this module's top

  generic = {"chain", "named_chain", "identity", "scale", "init_empty_state", "with_extra_args_support"}
  found = sorted(n for n in names if n and not n.startswith("_") and n not in generic and (
      hasattr(optax, n) or hasattr(optax.contrib, n)))
  return ", ".join(found) or "tx"
