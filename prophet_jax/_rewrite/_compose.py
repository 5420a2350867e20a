"""Where `scheduled` sits in the user's optax composition: it must run first (`check_first`,
`inside_multisteps` read the Python stack while optax calls it; `check_masked` refuses a mask hiding
part of its tree); `check_composition` tests any other composition numerically."""

from __future__ import annotations

import functools
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._values._errors import CompositionError
from .._values._schedule import Schedule
from .._values._checks import check_int
from .._values._tree import is_float_dtype, path_str

# Where `scheduled` sits in the user's optax composition is visible on the Python stack while the
# composition calls it (at init, eagerly, and at trace time): optax.chain and optax.named_chain call
# their members from a loop whose locals say which members ran before; optax.MultiSteps calls it from
# its `update`. These are the code objects of those functions (shared by every instance).


@functools.lru_cache(maxsize=1)
def _optax_codes() -> dict[str, Any]:
  ident = optax.identity()
  chain = optax.chain(ident)
  named = optax.named_chain(("a", ident))
  return {"chain.init": chain.init.__code__, "chain.update": chain.update.__code__,
          "named.init": named.init.__code__, "named.update": named.update.__code__,
          "multisteps.update": optax.MultiSteps.update.__code__}


def _transform_name(fn: Any) -> str:
  """'clip_by_global_norm' for optax's `clip_by_global_norm.<locals>.update_fn`."""
  q = getattr(fn, "__qualname__", None) or type(fn).__name__
  name = q.split(".<locals>")[0] if ".<locals>" in q else q
  if name == "with_extra_args_support":  # optax.chain's wrapper of a plain GradientTransformation
    for cell in getattr(fn, "__closure__", None) or ():
      inner = getattr(cell.cell_contents, "update", None)
      if callable(inner):
        return _transform_name(inner)
  return name


def check_first(where: str, max_depth: int = 40) -> None:
  """CompositionError naming the transformations an enclosing optax.chain / named_chain ran before the
  current member (`scheduled`'s `where`: 'init' or 'update'), if any.

  Walks up the Python stack from the caller (plain host Python: at init, or while jax traces the step).
  Nothing is raised when no enclosing chain is found or every enclosing chain is at its first member.
  """
  codes = _optax_codes()
  before: list[str] = []
  callee, frame = None, sys._getframe(2)
  for _ in range(max_depth):
    if frame is None:
      break
    code = frame.f_code
    try:
      loc = frame.f_locals if any(code is c for c in codes.values()) else {}
      if code is codes["chain.update"]:
        k = len(loc.get("new_state", ()))
        before += [_transform_name(f) for f in loc.get("update_fns", ())[:k]]
      elif code is codes["chain.init"] and callee is not None:
        cur = callee.f_locals.get("fn")  # the generator expression calling each member's init
        fns = list(loc.get("init_fns", ()))
        k = next((i for i, f in enumerate(fns) if f is cur), 0)
        before += [f"the chain's member #{i}" for i in range(k)]
      elif code in (codes["named.init"], codes["named.update"]):
        k = len(loc.get("states", loc.get("new_state", ())))
        before += [name for name, _ in loc.get("transforms", ())[:k]]
    except (TypeError, AttributeError):  # an optax version whose locals differ: no diagnosis
      pass
    callee, frame = frame, frame.f_back
  if not before:
    return
  names = ", ".join(before)
  those = "<those transformations>" if any(b.startswith("the chain's") for b in before) else names
  raise CompositionError(
      f"scheduled(...) {where} runs after {names} in an optax.chain: those transformations would act "
      f"on each device's own gradients before the all-reduce, which gives another (silently wrong) "
      f"result than applying them to the all-reduced gradients. `scheduled` must be the first "
      f"transformation: wrap the rest instead, e.g. prophet_jax.scheduled(optax.chain({those}, tx), "
      f"schedule, axis_name=...).")


def inside_multisteps(max_depth: int = 100) -> bool:
  code, frame = _optax_codes()["multisteps.update"], sys._getframe(2)
  for _ in range(max_depth):
    if frame is None:
      return False
    if frame.f_code is code:
      return True
    frame = frame.f_back
  return False


def check_masked(updates: Any, schedule: Schedule) -> None:
  """CompositionError when `scheduled` runs inside `optax.masked` / `optax.multi_transform` and sees
  only part of the tree its schedule was planned for (the other leaves arrive as optax's MaskedNode).

  With a mask (or partition) that gives this transformation every leaf, or a schedule planned for
  exactly the leaves it sees, nothing is raised: that composition works. Otherwise the leaves masked
  away from `scheduled` would not be all-reduced by it, and the schedule's rows for them have no leaf:
  the message names them and the two compositions that work.
  """
  with_masks, _ = jax.tree_util.tree_flatten_with_path(updates, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
  masked = [path_str(p) for p, x in with_masks if isinstance(x, optax.MaskedNode)]
  if not masked:
    return
  present = {path_str(p) for p, x in with_masks if not isinstance(x, optax.MaskedNode)}
  alias = lambda p: p[:-len("/value")] if p.endswith("/value") else p  # noqa: E731 (nnx spelling)
  present |= {alias(p) for p in present}
  missing = [r[0] for r in schedule.rows if r[0] not in present and alias(r[0]) not in present]
  if not missing:
    return   # the schedule covers exactly what this transformation sees: a partition of its own
  raise CompositionError(
      f"scheduled(...) runs inside optax.masked or optax.multi_transform, which give it only part of the "
      f"gradient tree: {len(masked)} leaves are masked away from it (e.g. {masked[:3]}), and the "
      f"schedule was planned for {len(schedule.rows)} leaves, {len(missing)} of them masked away (e.g. "
      f"{missing[:3]}); the model did not change. Either make scheduled the outermost transformation, "
      f"prophet_jax.scheduled(optax.multi_transform(...), schedule, axis_name=...) (every leaf "
      f"all-reduced, then partitioned), or plan a schedule for exactly the leaves this partition gets "
      f"(GradientProfile.from_params of that subtree) and give every other partition its own "
      f"scheduled(...) (a masked-away leaf that no scheduled(...) reduces is never all-reduced).")


def check_composition(tx: optax.GradientTransformation, params: Any, *, axis_name: str | tuple[str, ...],
                      num_devices: int = 4, steps: int = 4, seed: int = 0,
                      rtol: float = 1e-5) -> None:
  """Checks numerically that `tx`'s update depends only on the mean of the per-device gradients.

  That is what a data-parallel optimizer must compute, and what `scheduled(...)` outermost gives. The
  check runs one `init` and `steps` updates of `tx` under `jax.vmap(..., axis_name=axis_name)` over
  `num_devices` simulated devices (on the default device, no mesh needed), twice: with random
  per-device gradients g_i, and with g_i + d_i where the d_i sum to zero (at a small and at a large
  scale, so clipping thresholds are crossed either way). Both must give the same update on every
  device. A transformation before the all-reduce that is not linear in the gradients (clipping,
  normalising, `scale_by_adam`), or a missing all-reduce, makes the update depend on the d_i and
  fails the check. Use it in a test or once at start-up for compositions the automatic check of
  `scheduled` cannot see (a custom wrapper, `optax.multi_transform`, ...).

  Args:
    tx: the user's whole optimizer (containing `scheduled(...)` somewhere).
    params: the params (or a tree of arrays / ShapeDtypeStructs shaped like them).
    axis_name: the axis name `scheduled` was given.
    num_devices: simulated devices (>= 2).
    steps: updates to run (each compared), enough for e.g. `optax.MultiSteps` to emit one.
    seed: for the random gradients.
    rtol: allowed difference, relative to the largest update (the reduced gradients are exact, so
      a correct composition gives identical updates).

  Raises:
    CompositionError: the update depends on more than the mean gradient (names the leaf and the size
      of the difference).
    ValueError: `num_devices` < 2.
  """
  check_int("check_composition", "num_devices", num_devices, lo=2)
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
  shapes = [(tuple(np.shape(x)), jnp.dtype(x.dtype)) for _, x in leaves_with_path]
  paths = [path_str(p) for p, _ in leaves_with_path]
  params = jax.tree_util.tree_unflatten(treedef, [jnp.zeros(s, d) for s, d in shapes])
  rng = np.random.default_rng(seed)

  # Values on a grid that every float dtype here holds exactly (multiples of 2**-8 below 2**13 in
  # float32; small integers in 16-bit floats), so g_i + d_i and every partial sum over the devices are
  # exact: the all-reduced mean is bit-identical in all three runs, and any difference in the update
  # comes from a transformation that saw the per-device values.
  def grid(shape: tuple[int, ...], dtype: Any, spread: float) -> np.ndarray:
    if jnp.dtype(dtype).itemsize >= 4:
      return np.round(np.clip(rng.standard_normal(shape) * spread, -2 ** 12, 2 ** 12) * 256) / 256
    return np.round(np.clip(rng.standard_normal(shape) * min(spread, 4.0), -16, 16))

  inexact = [is_float_dtype(d) for _, d in shapes]
  base = [grid((num_devices, *s), d, 1.0).astype(np.float32) if f else np.zeros((num_devices, *s), d)
          for (s, d), f in zip(shapes, inexact)]
  def shifted(g: np.ndarray, s: tuple[int, ...], d: Any, spread: float) -> np.ndarray:
    dev = np.zeros_like(g)
    dev[0] = grid(s, d, spread).astype(np.float32)
    dev[1] = -dev[0]  # sums to exactly zero
    return g + dev

  variants = [[shifted(g, s, d, spread) if f else g for g, (s, d), f in zip(base, shapes, inexact)]
              for spread in (0.1, 1e3)]
  def one(flat_g):
    g = jax.tree_util.tree_unflatten(treedef, [x.astype(d) if is_float_dtype(d) else x
                                               for x, (_, d) in zip(flat_g, shapes)])
    # init where the axis is bound (a sharded schedule's state is each device's shard state)
    st, outs = tx.init(params), []
    for _ in range(steps):  # several steps, so that e.g. optax.MultiSteps emits an update
      u, st = tx.update(g, st, params)
      outs += [jnp.asarray(x, jnp.float32) for x in jax.tree_util.tree_leaves(u)]
    return outs

  run = jax.jit(jax.vmap(one, axis_name=axis_name))
  ref = [np.asarray(x) for x in run(base)]
  paths = paths * steps
  scale = max((float(np.max(np.abs(x))) for x in ref if x.size), default=0.0)
  for i, x in enumerate(ref):
    spread = float(np.max(np.abs(x - x[:1]))) if x.size else 0.0
    if spread > rtol * scale:
      raise CompositionError(
          f"check_composition: the updates differ across the {num_devices} simulated devices (leaf "
          f"{paths[i] if i < len(paths) else i!r}: by {spread:.3g}, the largest update is {scale:.3g}): "
          f"no all-reduce runs before them. Wrap the optimizer: prophet_jax.scheduled(tx, schedule, "
          f"axis_name={axis_name!r}).")
  for v in variants:
    got = [np.asarray(x) for x in run(v)]
    for i, (x, y) in enumerate(zip(got, ref)):
      diff = float(np.max(np.abs(x - y))) if x.size else 0.0
      if diff > rtol * scale:
        raise CompositionError(
            f"check_composition: the update of leaf {paths[i] if i < len(paths) else i!r} changes "
            f"(by {diff:.3g}; the largest update is {scale:.3g}) when the per-device gradients change "
            f"but their mean does not: some transformation acts on each device's own gradients "
            f"before the all-reduce (clipping, normalising, ...). Make scheduled(...) the outermost "
            f"transformation: prophet_jax.scheduled(optax.chain(<the others>, tx), schedule, "
            f"axis_name={axis_name!r}).")
