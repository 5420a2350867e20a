"""Tree comparison with docs/design.md's one equivalence tolerance (no chex dependency)."""

from __future__ import annotations

import numpy as np


def _leaves(tree):
  import jax

  return jax.tree_util.tree_flatten_with_path(tree)[0]


def assert_trees_close(got, ref, before, *, rel=None, tree_floor=0.0):
  """max|got - ref| <= rel * max|ref - before| per leaf (rel: 1e-3 float32, 1e-2 bfloat16).

  Measured against the size of the update, since float32 summation order differs between a single
  device, a pmean and chunked sums. `tree_floor` adds that fraction of the largest update in the
  tree to every leaf's allowance: for models with leaves whose true gradient is zero (an attention
  key bias: softmax ignores a shift), whose "update" is float noise. Raises AssertionError naming
  the leaf.
  """
  import jax

  g, r, b = _leaves(got), _leaves(ref), _leaves(before)
  assert len(g) == len(r) == len(b), f"trees differ in leaf count: {len(g)}, {len(r)}, {len(b)}"
  as64 = lambda v: np.asarray(v, dtype=np.float64)  # noqa: E731
  floor = tree_floor * max((float(np.max(np.abs(as64(y) - as64(z)), initial=0.0))
                            for (_, y), (_, z) in zip(r, b)), default=0.0)
  for (path, x), (_, y), (_, z) in zip(g, r, b):
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    dtype = str(np.asarray(y).dtype)
    x, y, z = (np.asarray(v, dtype=np.float64) for v in (x, y, z))
    assert x.shape == y.shape, f"{name}: shape {x.shape} != {y.shape}"
    if x.size == 0:
      continue
    tol = rel if rel is not None else (1e-2 if dtype == "bfloat16" else 1e-3)
    scale = float(np.max(np.abs(y - z)))
    err = float(np.max(np.abs(x - y)))
    assert err <= tol * scale + floor + 1e-30, (f"{name}: max|got-ref|={err:.3e} > {tol:g} * update size "
                                                f"{scale:.3e} + floor {floor:.3e}")
