"""The program harness behind `profile_step`: a user's loss checked, and its programs on a 1-D mesh."""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .._compiled._devices import profiled_axis, profiled_devices
from .._values._checks import check_int
from .._values._errors import ProfileError
from .._compiled._jaxpr import forward_paths
from .._values._tree import check_layer_depth, is_reduced_leaf, layer_of, layer_path, path_str
from .._values._types import itemsize

AXIS = "prophet_profile"
STEP_NAME = "prophet_profile_step"
UPDATE_NAME = "prophet_profile_update"

# --------------------------------------------------------------------------------------------------
# Setup shared by every method


@dataclasses.dataclass
class RowSpec:
  """Per gradient leaf k (the grad program's output k) its path, shape, dtype and layer; the rows' forward order."""

  paths: list[str]
  shapes: list[tuple[int, ...]]
  dtypes: list[str]
  layers: list[str]
  order: list[int]

  @property
  def layers_in_order(self) -> list[str]:
    return list(dict.fromkeys(self.layers[k] for k in self.order))

  def nbytes(self, k: int) -> int:
    return int(math.prod(self.shapes[k])) * itemsize(self.dtypes[k])

  def layer_bytes(self) -> dict[str, int]:
    out = dict.fromkeys(self.layers_in_order, 0)
    for k, layer in enumerate(self.layers):
      out[layer] += self.nbytes(k)
    return out


@dataclasses.dataclass
class ProgramSetup:
  """Everything the methods share: the mesh, the placed inputs, the rows and the loss of flat leaves."""

  mesh: Any
  axis: str                   # the mesh's one axis: the data axis the loss may name (BatchNorm's axis_name)
  num_devices: int
  batch: Any                  # sharded on the mesh
  diff_idx: list[int]         # flat indices of the differentiated (floating) leaves, flatten order
  leaves: list[Any]           # every leaf, on the mesh
  rows: RowSpec               # the differentiated leaves' paths, shapes, dtypes, layers and forward order
  loss_of: Callable[..., Any]  # (diff_leaves, other_leaves, batch) -> scalar


def setup(loss_fn, params, batch, num_devices, layer_depth, mesh=None, axis_name=None) -> ProgramSetup:
  check_layer_depth("profile_step", layer_depth)
  axis = profiled_axis(mesh, axis_name, AXIS, "profile_step")
  devices = profiled_devices(mesh, axis_name, "profile_step")
  n = check_int("profile_step", "num_devices", len(devices) if num_devices is None else num_devices, lo=1)
  if n > len(devices):
    raise ValueError(f"profile_step(num_devices={n}): only {len(devices)} {devices[0].platform} device(s) "
                     f"here. On the CPU set XLA_FLAGS=--xla_force_host_platform_device_count={n} before "
                     f"jax starts.")
  mesh = jax.sharding.Mesh(np.asarray(devices[:n]), (axis,))

  flat, treedef, diff_idx = float_leaves(params, "profile_step", "arrays")
  paths = [path_str(p) for p, _ in flat]
  leaves = [x for _, x in flat]
  bflat, _ = jax.tree_util.tree_flatten_with_path(batch)
  if not bflat:
    raise ValueError("profile_step: the batch has no array leaves; pass the global batch (leading axis = "
                     "examples).")
  for kp, x in bflat:
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) == 0 or shape[0] % n or shape[0] == 0:
      raise ValueError(
          f"profile_step: batch leaf {'batch/' + path_str(kp) if kp else 'batch'!r} has shape "
          f"{tuple(shape) if shape is not None else None}; every batch leaf needs a leading (example) "
          f"axis divisible by num_devices={n}, e.g. ({8 * n}, ...).")

  dset = set(diff_idx)

  def loss_of(diff_leaves, other_leaves, b):
    di, oi = iter(diff_leaves), iter(other_leaves)
    full = [next(di) if i in dset else next(oi) for i in range(len(leaves))]
    return loss_fn(jax.tree_util.tree_unflatten(treedef, full), b)

  # Abstract check: differentiable, scalar, batch shapes the model accepts (per-device shapes), traced
  # with the data axis bound as in training (a model's BatchNorm(axis_name=...) reduces over it).
  diff = [leaves[i] for i in diff_idx]
  other = [x for i, x in enumerate(leaves) if i not in dset]
  local_batch = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct((x.shape[0] // n, *x.shape[1:]), x.dtype), batch)
  env = [(axis, n)]
  try:
    out = jax.make_jaxpr(loss_fn, axis_env=env, return_shape=True)(params, local_batch)[1]
  except NameError as e:
    raise _unbound(e, axis) from e
  except Exception as e:  # noqa: BLE001 - re-raised with context
    raise ValueError(
        f"profile_step: loss_fn(params, batch) failed on a per-device batch of shapes "
        f"{_shapes(local_batch)} (the global batch split over {n} devices): {type(e).__name__}: "
        f"{str(e).splitlines()[0] if str(e) else ''}. Check the batch's shapes against the model.") from e
  if not hasattr(out, "shape") or out.shape != () or not is_reduced_leaf(out):
    raise TypeError(f"profile_step: loss_fn must return a real floating scalar to be differentiated; it "
                    f"returned {getattr(out, 'dtype', type(out).__name__)}{tuple(getattr(out, 'shape', ()))}."
                    f" Reduce the loss to a scalar (e.g. jnp.mean) and return aux values separately.")
  try:
    jax.make_jaxpr(jax.grad(loss_of), axis_env=env)(diff, other, local_batch)
  except Exception as e:  # noqa: BLE001
    raise TypeError(f"profile_step: loss_fn is not differentiable in params: {type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''}. Every floating parameter must reach the "
                    f"loss through differentiable operations.") from e

  # Forward (priority) order: first use in the loss's jaxpr.
  pos = {p: k for k, p in enumerate(forward_paths(loss_fn, params, local_batch, axis_env=env))}
  order = sorted(range(len(diff_idx)), key=lambda k: (pos.get(paths[diff_idx[k]], len(pos)), k))

  leaves_d = list(jax.tree_util.tree_leaves(jax.device_put(params, NamedSharding(mesh, P()))))
  diff_d = [leaves_d[i] for i in diff_idx]   # shapes and dtypes as placed (float64 is float32 without x64)
  layers = [layer_of(layer_path(flat[i][0]), layer_depth) for i in diff_idx]  # an nnx Variable's '.value': no layer
  rows = RowSpec(paths=[paths[i] for i in diff_idx], shapes=[tuple(x.shape) for x in diff_d],
                 dtypes=[str(x.dtype) for x in diff_d], layers=layers, order=order)
  return ProgramSetup(mesh=mesh, axis=axis, num_devices=n, diff_idx=diff_idx, leaves=leaves_d,
                      batch=jax.device_put(batch, NamedSharding(mesh, P(axis))), rows=rows, loss_of=loss_of)


def float_leaves(params: Any, where: str, expected: str) -> tuple[list[tuple[Any, Any]], Any, list[int]]:
  """The params' (key path, leaf) pairs, their treedef, and the indices of the floating leaves (the rows)."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  for p, x in flat:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{where}: leaf {path_str(p)!r} of params is a {type(x).__name__}; expected {expected}.")
  rows = [i for i, (_, x) in enumerate(flat) if is_reduced_leaf(x)]
  if not rows:
    raise ProfileError(f"{where}: params have no floating-point leaves, so there is no gradient to profile; "
                       f"pass the model's float parameters (or, to read a trace, their ShapeDtypeStructs).")
  return flat, treedef, rows


def _unbound(e: NameError, axis: str) -> Exception:
  m = re.search(r"unbound axis name: ([^\s.,]+)", str(e))
  if m is None:
    return e
  name = m.group(1)
  return ValueError(f"profile_step: loss_fn reduces over the axis {name!r} (e.g. flax's BatchNorm(axis_name="
                    f"{name!r}) or a lax.pmean), but the profiled step maps its batch over {axis!r}. Pass "
                    f"axis_name={name!r}, the axis your training step maps the batch over.")


def _shapes(tree: Any) -> str:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return "{" + ", ".join(f"{path_str(k) or 'batch'}: {tuple(x.shape)}" for k, x in flat) + "}"


def split_leaves(s: ProgramSetup) -> tuple[list[Any], list[Any]]:
  dset = set(s.diff_idx)
  return ([s.leaves[i] for i in s.diff_idx], [x for i, x in enumerate(s.leaves) if i not in dset])


def grad_program(s: ProgramSetup, wrt: Sequence[int] | None = None, name: str = STEP_NAME):
  """jit(shard_map(grad)) over the mesh, with no all-reduce; `wrt` restricts it to some leaves."""
  def step(diff, other, b):
    if wrt is None:
      return jax.grad(s.loss_of)(diff, other, b)
    keep = list(wrt)

    def part(sub, diff, other, b):
      full = list(diff)
      for k, x in zip(keep, sub):
        full[k] = x
      return s.loss_of(full, other, b)

    return jax.grad(part)([diff[k] for k in keep], diff, other, b)

  return mapped(s, step, (P(), P(), P(s.axis)), P(), name=name)


def loss_program(s: ProgramSetup):
  return mapped(s, s.loss_of, (P(), P(), P(s.axis)), P())


def mapped(s: ProgramSetup, f: Callable[..., Any], in_specs: Any, out_specs: Any, *, name: str = "") -> Any:
  """`jax.jit(jax.shard_map(f))` over the profile's mesh; `name` renames `f`, so the module is `jit_<name>`."""
  if name:
    f.__name__ = f.__qualname__ = name
  return jax.jit(jax.shard_map(f, mesh=s.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))


def wall_median(f: Callable[[], Any], repeats: int, least: int = 3) -> float:
  """The median wall clock of `repeats` (at least `least`) calls of `f`, after one untimed call."""
  jax.block_until_ready(f())
  ts = []
  for _ in range(max(least, repeats)):
    t0 = time.perf_counter()
    jax.block_until_ready(f())
    ts.append(time.perf_counter() - t0)
  return float(statistics.median(ts))


@dataclasses.dataclass(eq=False)
class Prog:
  """A lowered program with its arguments: compiled once, then run by calling it."""

  lowered: Any
  args: tuple[Any, ...]
  compiled: Any = None

  def compile(self) -> Prog:
    if self.compiled is None:
      self.compiled = self.lowered.compile()
    return self

  def __call__(self) -> Any:
    return self.compile().compiled(*self.args)


def compile_all(progs: Sequence[Prog | None]) -> None:
  """Compiles the programs at once (XLA releases the GIL while it compiles)."""
  todo = [p for p in progs if p is not None and p.compiled is None]
  if todo:
    with ThreadPoolExecutor(len(todo)) as pool:
      list(pool.map(Prog.compile, todo))


def update_program(s: ProgramSetup, tx: Any) -> Prog:
  diff, _ = split_leaves(s)
  state = tx.init(diff)
  f = mapped(s, _updater(tx), (P(), P(), P()), (P(), P()), name=UPDATE_NAME)
  grads = jax.tree_util.tree_map(lambda x: x * 0 + 1e-3, diff)
  return Prog(f.lower(diff, grads, state), (diff, grads, state))


def _updater(tx: Any) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
  def upd(p, g, st):
    u, st = tx.update(g, st, p)
    return optax.apply_updates(p, u), st

  return upd


def local_step_program(s: ProgramSetup, tx: Any) -> Prog:
  """A train step with no reduction (gradients, then `tx`'s update, in one program)."""
  diff, other = split_leaves(s)
  state = tx.init(diff)

  def local_step(p, o, b, st):
    return _updater(tx)(p, jax.grad(s.loss_of)(p, o, b), st)

  f = mapped(s, local_step, (P(), P(), P(s.axis), P()), (P(), P()))
  return Prog(f.lower(diff, other, s.batch, state), (diff, other, s.batch, state))
