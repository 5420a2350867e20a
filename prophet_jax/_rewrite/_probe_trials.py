"""The trials of ZeRO-1's shardability probe (`_zero.shard_mode`): gradients at scales 1e-6 ... 1e6 whose
shards hold very different norms, and one NaN in one shard, so a transformation deciding from the whole
update (a global norm, a finiteness check) decides differently on shards; the extra arguments the probe
passes; the optax factory names a refusal gives."""

from __future__ import annotations

import numpy as np

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
