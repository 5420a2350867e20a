"""The mesh path: the library's per-device steps inside a user's plain `jax.jit` on global arrays.

Most JAX data-parallel code now is a plain `jax.jit` (or `nnx.jit`) over global arrays: params placed
`NamedSharding(mesh, P())`, the batch `NamedSharding(mesh, P("dp"))`, and the partitioner inserts the
gradient all-reduce, which nobody schedules. With `mesh=`, `hooked` and `pipelined` meet that code
where it is: the function they return takes and returns global arrays and runs, inside the user's
`jit`, the same per-device program as under `jax.shard_map` (`jax.shard_map` over `mesh`, made here):

- params and any other replicated input (a model state) enter with `P()`, the batch (the last
  argument) with `P(axis_name)` on its leading (example) axis; the per-device function casts the params
  to varying itself (docs/facts.md, "The 8x gradient trap"), so `jax.grad` inside sums nothing and
  the only gradient all-reduces in the compiled program are the schedule's chunks;
- the gradients leave with `P()` (replicated, as a plain `jax.jit` step returns them), the loss as
  the mean over the global batch (one scalar `pmean`: the plain step's loss), the model state with
  `P()` (it must be the same on every device), the auxiliary output per device, stacked on a new
  leading axis (`P(axis_name)`: `aux[i]` is device i's value), the deferral state's residuals with
  `P(axis_name)` (each device's own, on their leading axis).

The map is manual over *every* axis of the mesh: the other axes only replicate the per-device program
(no collective runs over them; the chunks' all-reduces run over the data axis alone, one per group of
the other axes). Leaving the other axes to the partitioner (`axis_names={axis}`) was tried and gave
silently wrong gradients for a parameter sharded over another axis (jax 0.10.2, Auto axes: the
chunks' flattening of a cotangent the partitioner kept sharded), so the map owns every axis and a
parameter placed otherwise is gathered at the boundary (Auto axes) or refused (Explicit axes).

Where placement is visible (a concrete `jax.Array`'s sharding, or, in a trace, the type of a value on
a mesh with Explicit axes: `jax.make_mesh`'s default), bad placement is refused before anything is
traced, naming the leaf, its spec and the fix: params not replicated, a batch leaf not split over the
data axis on its leading axis, a deferral state in the per-device layout. Auto axes inside a `jit`
carry no placement in the type: there `shard_map` reshards what it is given (correct, but a gather
or a slice per step). A batch whose leading axis does not divide over the data axis, and an axis the
mesh lacks, are refused everywhere.

Gradients obtained *unreduced* (jax's `reduced`/`unreduced` sharding types: differentiate with
respect to params resharded to `P(reduced={axis})` and `jax.grad` returns each device's partial sum,
typed `{U:axis}`, with no all-reduce) are reduced on the schedule by `scheduled(tx, ..., mesh=)`'s
`update` (`MeshTransformation`): a `shard_map` whose in_specs keep the gradients unreduced and whose
body runs the per-device update on them as sums (the partial sums already carry the mean's 1/batch),
so the compiled program's gradient all-reduces are the schedule's, in order.

This module is the placement layer: `placed`, `placed_grad_fn` and `placed_step` return a front-end's
per-device function as it is without a mesh, or wrapped over the mesh. It owns the placement checks
(`_placement`) and specs, and reads the library's states only through the state layer (`_states`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from . import _loss_reduction, _states
from ._pending import check_state
from ._defer import deferred_grads as _deferred_grads
from ._placement import (check_model_state, check_not_mapped, explicit_axes, known_spec, named_leaves, spec_axes,
                         spec_entry, check_batch, check_replicated)
from .._compiled._devices import mesh_axis_names, axis_total, check_mesh, data_axes
from .._values._errors import AlreadyReducedError
from .._values._schedule import Schedule
from .._values._tree import is_reduced_leaf

__all__ = ["data_axes", "check_mesh", "axis_total", "MeshGradFn", "MeshPipelined", "MeshTransformation",
           "placed", "placed_grad_fn", "placed_step", "place_state", "check_layout"]

P = PartitionSpec


# --------------------------------------------------------------------------------------------------
# per device, stacked


def _stack(tree: Any) -> Any:
  """Each leaf with a new leading axis of 1 (per device; `P(axis)` makes it the device axis)."""
  return jax.tree_util.tree_map(lambda a: jnp.expand_dims(jnp.asarray(a), 0), tree)


# --------------------------------------------------------------------------------------------------
# hooked(..., mesh=)


class MeshGradFn:
  """`hooked(loss_fn, schedule, axis_name=..., mesh=...)`'s gradient function, on global arrays.

  Call it inside your own `jax.jit` (or `nnx.jit`), or eagerly:

  - `grad_fn(params, batch) -> (loss, grads)`; `grad_fn(params, model_state, batch)` with a model
    state (any arguments between the params and the batch are replicated inputs of `loss_fn`);
  - with `has_aux`: `((loss, aux), grads)`; with `has_state`: `((loss, new_model_state), grads)`;
    with both: `((loss, (new_model_state, aux)), grads)`, as `jax.value_and_grad(loss_fn,
    has_aux=True)` would return them;
  - with a deferring schedule, the deferral state is the last argument (or `defer_state=`) and the
    new one is returned last: `(value, grads, new_defer_state)`; start from `grad_fn.defer_state()`.

  `loss` is the mean over the global batch (`loss_fn`'s per-device means averaged); `grads` are
  replicated (`P()`), averaged over the data axis; `aux` is per device, stacked on a new leading axis
  (`aux[i]`: device i's value; sum or average it as its meaning says); the model state must come out
  the same on every device.

  Attributes:
    mesh: the mesh.
    axis_name: the data axis.
    schedule: the schedule its all-reduces carry out.
  """

  def __init__(self, per_device: Callable[..., Any], schedule: Schedule, *, mesh: Any, axis_name: Any,
               has_aux: bool, has_state: bool, where: str = "hooked", init_state: Callable[[], Any] | None = None,
               reduction: str = "mean"):
    self._axes = check_mesh(mesh, axis_name, where)
    self._fn = per_device
    self._init_state = init_state   # the per-device state before the first step (None: the step has none)
    self.reduction = reduction
    self.mesh = mesh
    self.axis_name = axis_name
    self.schedule = schedule
    self._has_aux = has_aux
    self._has_state = has_state
    self._where = where

  def defer_state(self) -> Any:
    """The deferral state before the first step, on the mesh (None when the schedule defers nothing):
    each device's (zero) residual on the leading axis, `P(axis_name)`, the rest replicated."""
    if self._init_state is None:
      return None
    return place_state(self._init_state, self.mesh, self.axis_name, "defer_state")

  def defer_state_abstract(self) -> Any:
    """The per-device state before the first step, abstract (None when the step keeps none)."""
    return None if self._init_state is None else jax.eval_shape(self._init_state)

  def deferred_grads(self, defer_state: Any, params: Any) -> Any:
    """The deferred gradient values in `defer_state` (this grad_fn's, on the mesh), combined over the
    data axis (the mean; the sum with reduction='sum'), as a replicated tree like `params` (zeros
    when nothing is deferred): apply them with `tx` at the end of training, as `MeshPipelined` does."""
    where = f"{self._where}(mesh=...)'s grad_fn.deferred_grads"
    entry = spec_entry(self._axes)
    if defer_state is not None:
      check_layout(defer_state, axis_total(self.mesh, self._axes), where,
                   "Pass the state this grad_fn returned (it starts from grad_fn.defer_state()).")
    specs = _states.state_specs(defer_state, entry) if defer_state is not None else P()
    body = lambda s, p: _loss_reduction.combine(_deferred_grads(s, p), self._axes, self.reduction)  # noqa: E731
    # jitted: un-jitted, a shard_map runs op by op on every device
    return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(specs, P()), out_specs=P()))(defer_state, params)

  def _value_specs(self) -> Any:
    data = P(spec_entry(self._axes))
    if self._has_state and self._has_aux:
      return (P(), (P(), data))
    if self._has_state:
      return (P(), P())
    if self._has_aux:
      return (P(), data)
    return P()

  def __call__(self, params: Any, *args: Any, **kwargs: Any) -> Any:
    where, axes = f"{self._where}(mesh=...)'s grad_fn", self._axes
    args = list(args)
    defer_state = None
    stateful = self.defer_state_abstract() is not None
    if stateful:
      if "defer_state" in kwargs:
        defer_state = kwargs.pop("defer_state")
      elif len(args) >= 2:
        defer_state = args.pop()
      else:
        raise TypeError(f"{where}: the schedule defers, so the grad_fn takes its deferral state last: "
                        f"grad_fn(params, batch, defer_state), starting from grad_fn.defer_state().")
    elif _states.is_state(kwargs.get("defer_state")) or (
        len(args) >= 2 and _states.is_state(args[-1])):   # a re-plan's state, carried over
      defer_state = kwargs.pop("defer_state") if "defer_state" in kwargs else args.pop()
      stateful = True
    if kwargs:
      raise TypeError(f"{where}: unexpected keyword arguments {sorted(kwargs)}; on the mesh every "
                      f"input is positional: grad_fn(params, [replicated inputs such as the model "
                      f"state, ...,] batch).")
    if not args:
      raise TypeError(f"{where}: no batch given; call grad_fn(params, batch) (or grad_fn(params, "
                      f"model_state, batch) with has_state=True).")
    if self._has_state and len(args) < 2:
      raise TypeError(f"{where}: has_state=True, so the grad_fn takes (params, model_state, batch); got "
                      f"{1 + len(args)} positional arguments.")
    *reps, batch = args
    check_not_mapped(axes, where)
    fix_params = ("Place them with jax.device_put(params, NamedSharding(mesh, P())) (or "
                  "jax.sharding.reshard(params, P()) inside a jit on Explicit axes).")
    check_replicated(params, "params", where, fix_params)
    for i, r in enumerate(reps):
      check_replicated(r, "model_state" if (self._has_state and i == 0) else f"input {i + 1}", where,
                       "Inputs between the params and the batch are replicated: place them with P().")
    check_batch(batch, self.mesh, axes, where)
    n = axis_total(self.mesh, axes)
    check_layout(defer_state, n, where, "Start from grad_fn.defer_state() and pass on the state each call "
                 "returns.")
    data = P(spec_entry(axes))

    def body(params, reps, batch, defer_state):
      extra = {"defer_state": defer_state} if stateful else {}
      out = self._fn(params, *reps, batch, **extra)
      value, grads = out[0], out[1]
      if self._has_aux or self._has_state:
        loss, rest = value
        if self._has_state and self._has_aux:
          new_state, aux = rest
          check_model_state(new_state, axes, where)
          rest = (new_state, _stack(aux))
        elif self._has_state:
          check_model_state(rest, axes, where)
        else:
          rest = _stack(rest)
        value = (_loss_reduction.combine(loss, axes, self.reduction), rest)
      else:
        value = _loss_reduction.combine(value, axes, self.reduction)
      return (value, grads, out[2]) if stateful else (value, grads)

    dspec = _states.state_specs(defer_state, spec_entry(axes))
    # the step continues its own state; any other (a re-plan's) gives way to the first one
    first = self.defer_state_abstract()
    out_state = defer_state if jax.tree_util.tree_structure(defer_state) == jax.tree_util.tree_structure(
        first) else first
    dspec_out = _states.state_specs(out_state, spec_entry(axes))
    gspec = data if self.schedule.sharded else P()  # a sharded schedule's GradShards: each device's own
    outs = (self._value_specs(), gspec) + ((dspec_out,) if stateful else ())
    mapped = jax.shard_map(body, mesh=self.mesh, in_specs=(P(), P(), data, dspec), out_specs=outs)
    return mapped(params, tuple(reps), batch, defer_state)


# --------------------------------------------------------------------------------------------------
# pipelined(..., mesh=)


class MeshPipelined:
  """`pipelined(..., mesh=mesh)`: the pipelined step on global arrays, inside the user's `jax.jit`.

  The same `init`, `step`, `flush` as `Pipelined` (the per-device step it wraps, `inner`), each mapped
  over `mesh` itself: `init(params[, model_state])` returns the global state (params, optimizer and
  model state replicated; the deferral state's residuals and, once a forward is pending, the carried
  residuals on a leading device axis, `P(axis_name)`, as `state_specs()` says); `step(state, batch)`
  takes the global batch (split over the data axis) and returns the loss as the mean over the global
  batch (and the aux stacked per device on a new leading axis, as `hooked(mesh=)` does);
  `deferred_grads(state)` returns the deferred values averaged over the axis (replicated: what to
  apply with `tx` at the end). Every other attribute and method (`params`, `state_specs`,
  `residual_bytes`, `schedule`, ...) is the inner step's.

  Attributes:
    inner: the per-device `Pipelined` step.
    mesh: the mesh.
  """

  def __init__(self, inner: Any, *, mesh: Any):
    self.inner = inner
    self.mesh = mesh
    self._axes = check_mesh(mesh, inner.axis_name, "pipelined")

  def __getattr__(self, name: str) -> Any:  # the per-device step's fields and read-only helpers
    return getattr(self.inner, name)

  @property
  def _entry(self) -> Any:
    return spec_entry(self._axes)

  def init(self, params: Any, *model_state: Any) -> Any:
    """The global initial state (see `Pipelined.init`), mapped over the mesh."""
    where = "pipelined(mesh=...).init"
    check_not_mapped(self._axes, where)
    check_replicated(params, "params", where, "Place them with jax.device_put(params, NamedSharding("
                     "mesh, P())).")
    if model_state:
      check_replicated(model_state[0], "model_state", where,
                       "The model state is replicated: place it with P().")
    args = (params, *model_state)
    return jax.shard_map(self.inner.init, mesh=self.mesh, in_specs=tuple(P() for _ in args),
                         out_specs=self.inner.state_specs())(*args)

  def step(self, state: Any, batch: Any) -> tuple[Any, Any]:
    """One pipelined step on the global state and batch (see `Pipelined.step`): returns the new state
    and the loss averaged over the global batch (with `has_aux`, `(loss, aux)`, aux stacked per device).
    """
    where = "pipelined(mesh=...).step"
    check_state(state, where)
    check_not_mapped(self._axes, where)
    check_replicated(state.params, "params", where, "Start from this step's init(params).")
    check_batch(batch, self.mesh, self._axes, where)
    self._check_global_defer(state, where)
    specs = self.inner.state_specs()
    data = P(self._entry)

    def body(state, batch):
      new, out = self.inner.step(state, batch)
      if self.inner.has_aux:
        loss, aux = out
        return new, (_loss_reduction.combine(loss, self._axes, self.inner.reduction), _stack(aux))
      return new, _loss_reduction.combine(out, self._axes, self.inner.reduction)

    value_spec = (P(), data) if self.inner.has_aux else P()
    return jax.shard_map(body, mesh=self.mesh, in_specs=(specs, data),
                         out_specs=(specs, value_spec))(state, batch)

  def flush(self, state: Any) -> Any:
    """Runs the pending backward, its all-reduces and the update (see `Pipelined.flush`), on the mesh."""
    where = "pipelined(mesh=...).flush"
    check_state(state, where)
    if state.pending is None:
      return state
    check_not_mapped(self._axes, where)
    self._check_global_defer(state, where)
    specs = self.inner.state_specs()
    return jax.shard_map(self.inner.flush, mesh=self.mesh, in_specs=(specs,), out_specs=specs)(state)

  def deferred_grads(self, state: Any) -> Any:
    """The deferred gradient values, averaged over the data axis, as a replicated tree like the params
    (zeros when nothing is deferred): apply them with `tx` at the end of training if wanted."""
    where = "pipelined(mesh=...).deferred_grads"
    check_state(state, where)
    self._check_global_defer(state, where)
    return jax.shard_map(lambda s: _loss_reduction.combine(self.inner.deferred_grads(s), self._axes,
                                                           self.inner.reduction),
                         mesh=self.mesh, in_specs=(self.inner.state_specs(),), out_specs=P())(state)

  def _check_global_defer(self, state: Any, where: str) -> None:
    check_layout(state, axis_total(self.mesh, self._axes), where,
                 "Start from this step's init(params), which makes the state on the mesh.")


# --------------------------------------------------------------------------------------------------
# a per-device state on the mesh (any of the state layer's: each device's parts on a leading axis)


_JITTED: dict[tuple, tuple[tuple, Any]] = {}


def _jitted(kind: str, objs: tuple, key: Any, make: Callable[[], Any]) -> Any:
  """The jitted state-making shard_map for (kind, these objects by identity, key: the mesh and axis),
  made once.

  Called eagerly (`TrainState.create`, `nnx.Optimizer`), an un-jitted shard_map runs its body op by op
  on every device (seconds per call on a small host); jitted once, a call is a cache hit; inside the
  user's jit it is inlined."""
  full = (kind, tuple(id(o) for o in objs), key)
  hit = _JITTED.get(full)
  if hit is not None and all(a is b for a, b in zip(hit[0], objs)):
    return hit[1]
  if len(_JITTED) > 32:
    _JITTED.clear()
  fn = make()
  _JITTED[full] = (objs, fn)
  return fn


def data_devices(mesh: Any, axis_name: Any, where: str) -> int | None:
  """Devices along `axis_name` (an axis or a tuple of axes) of `mesh`: the count a state's global layout
  has there; None without a mesh."""
  if mesh is None:
    return None
  if axis_name is None:
    raise ValueError(f"{where}: mesh= needs axis_name= (the data axis, or a tuple of axes) to count the "
                     f"devices the state is laid out over.")
  axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  missing = [a for a in axes if a not in mesh.shape]
  if missing:
    raise ValueError(f"{where}: axis_name={axis_name!r}: the mesh has axes {tuple(mesh.shape)}, not {missing}.")
  return int(np.prod([mesh.shape[a] for a in axes]))


def put_on(tree: Any, mesh: Any, specs: Callable[[], Any]) -> Any:
  """`tree` placed on `mesh` with the PartitionSpecs `specs()` gives (as it is without a mesh)."""
  if mesh is None:
    return tree
  return jax.tree_util.tree_map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs())


def place_state(make: Callable[[], Any], mesh: Any, axis_name: Any, where: str) -> Any:
  """The state `make()` builds per device, laid out on the mesh: its per-device parts (`state_specs`)
  on the leading axis of global arrays split over the data axis, the rest replicated (None stays None)."""
  axes = check_mesh(mesh, axis_name, where)
  abstract = jax.eval_shape(make)
  if abstract is None:
    return None
  specs = _states.state_specs(abstract, spec_entry(axes))
  return _jitted("state", (make,), (mesh, spec_entry(axes)), lambda: jax.jit(jax.shard_map(
      make, mesh=mesh, in_specs=(), out_specs=specs)))()


def check_layout(state: Any, n: int, where: str, fix: str) -> None:
  """ValueError when a per-device part of `state` (`_states.per_device_leaves`) is not on a leading
  axis of n devices (a state made per device, or for another device count, passed to the mesh)."""
  for name, x in _states.per_device_leaves(state):
    if np.shape(x)[:1] != (n,):
      raise ValueError(f"{where}: {name} has shape {tuple(np.shape(x))}, but on the mesh it holds each "
                       f"device's part on its leading axis ({n} devices): ({n}, ...). {fix}")


def _out_specs(fn: Callable[..., Any], args: tuple, in_specs: tuple, mesh: Any, entry: Any) -> Any:
  """The out_specs of `fn` mapped over the mesh: the state layer's specs of what it returns (traced
  once, abstractly: a state's structure may change, e.g. a re-plan's deferral state carried over)."""
  shapes = jax.eval_shape(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=P(), check_vma=False),
                          *args)
  return _states.state_specs(shapes, entry)


# --------------------------------------------------------------------------------------------------
# an optax transformation on the mesh: `scheduled(..., mesh=)`


def _check_unreduced(grads: Any, mesh: Any, axes: tuple[Any, ...], where: str) -> None:
  entry = spec_entry(axes)
  how = (f"differentiate with respect to params resharded to P(reduced={{{entry!r}}}) "
         f"(jax.sharding.reshard(p, P(*[None] * p.ndim, reduced={{{entry!r}}})) for every leaf, before "
         f"jax.grad), so that jax.grad leaves each device's partial sum unreduced")
  if not set(axes) <= explicit_axes(mesh):
    raise ValueError(
        f"{where}: gradients obtained unreduced need mesh axes of type Explicit (jax.make_mesh's "
        f"default; this mesh's are {dict(zip(mesh_axis_names(mesh), mesh.axis_types))}), where the type says "
        f"they are unreduced. With Auto axes use prophet_jax.hooked(loss_fn, schedule, "
        f"axis_name={entry!r}, mesh=mesh), which issues the chunks inside backward itself.")
  for name, g in named_leaves(grads, "grads"):
    if not is_reduced_leaf(g) or np.size(g) == 0:
      continue
    spec = jax.typeof(g).sharding.spec if isinstance(g, jax.core.Tracer) else known_spec(g)
    unreduced = set(getattr(spec, "unreduced", ()) or ()) if spec is not None else set()
    if not set(axes) <= unreduced:
      if spec is not None and not spec_axes(spec) and not unreduced:
        raise AlreadyReducedError(
            f"{where}: gradient {name!r} is replicated (type {jax.typeof(g)}): jax.grad already "
            f"all-reduced it over {entry!r} (the plain jit step's own all-reduce), and reducing it "
            f"again would be {axis_total(mesh, axes)} times too large. Obtain the gradients unreduced "
            f"instead: {how}; or use prophet_jax.hooked(loss_fn, schedule, axis_name={entry!r}, "
            f"mesh=mesh), which reduces them inside backward.")
      raise ValueError(
          f"{where}: gradient {name!r} (type {jax.typeof(g)}) is not unreduced over mesh axis "
          f"{entry!r}: the gradients must be each device's partial sums, typed {{U:{entry}}}: {how}.")


def _unreduced_specs(grads: Any, axes: tuple[Any, ...]) -> Any:
  """Each gradient's spec, kept unreduced over the data axes (jax has no cast from unreduced to
  varying: inside, with check_vma=False, the partial sums are plain per-device values)."""
  def spec_of(g):
    spec = jax.typeof(g).sharding.spec
    return spec if set(axes) <= set(getattr(spec, "unreduced", ()) or ()) else P()

  return jax.tree_util.tree_map(spec_of, grads)


class MeshTransformation:
  """A per-device optax transformation (`scheduled`'s), on global arrays inside a plain `jax.jit`.

  `init(params)` maps the per-device `init` over the mesh (params replicated; each device's parts of
  the state, `state_specs`, on a leading axis split over the data axis). `update(updates, state,
  params)` takes the gradients *unreduced* over the data axis (each device's partial sum of the global
  mean, typed `{U:axis}`), or a library state of per-device parts (`hooked(mesh=)`'s GradShards), and
  maps the per-device `update` over the mesh: the schedule's collectives are the program's only
  gradient reduction, the update comes out replicated. The per-device transformation was made for
  partial sums (`mean=False`: the partial sums already carry the mean's 1/batch).
  """

  def __init__(self, per_device: Any, *, mesh: Any, axis_name: Any, where: str, key: tuple = ()):
    self._axes = check_mesh(mesh, axis_name, where)
    self.inner, self.mesh, self.axis_name, self._where = per_device, mesh, axis_name, where
    self._key = key or (per_device,)   # what the per-device transformation is made of (its init's cache key)

  def init(self, params: Any) -> Any:
    where = f"{self._where}(mesh=...).init"
    check_not_mapped(self._axes, where)
    check_replicated(params, "params", where, "Place them with jax.device_put(params, NamedSharding(mesh, "
                     "P())).")
    entry, mesh, inner_init = spec_entry(self._axes), self.mesh, self.inner.init

    def make():   # the out_specs follow the params' structure: found while tracing, per structure
      return jax.jit(lambda p: jax.shard_map(inner_init, mesh=mesh, in_specs=P(), out_specs=_out_specs(
          inner_init, (p,), (P(),), mesh, entry))(p))

    return _jitted(f"init {self._where}", self._key, (mesh, entry), make)(params)

  def update(self, updates: Any, state: Any, params: Any = None, **extra_args: Any) -> tuple[Any, Any]:
    where, axes = f"{self._where}(mesh=...)", self._axes
    check_not_mapped(axes, where)
    entry = spec_entry(axes)
    check_layout(state, axis_total(self.mesh, axes), where,
                 "Make the optimizer state with this transformation's init on the mesh.")
    if _states.is_state(updates):   # per-device parts already (hooked(mesh=)'s gradient shards)
      gspecs = _states.state_specs(updates, entry)
    else:
      _check_unreduced(updates, self.mesh, axes, where)
      gspecs = _unreduced_specs(updates, axes)

    def body(g, st, p):
      return self.inner.update(g, st, p, **extra_args)

    in_specs = (gspecs, _states.state_specs(state, entry), P())
    out = _out_specs(body, (updates, state, params), in_specs, self.mesh, entry)
    # check_vma=False: inside, unreduced partial sums are plain per-device values
    return jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=(P(), out[1]),
                         check_vma=False)(updates, state, params)


def placed_step(step: Any, *, mesh: Any) -> Any:
  """The placement layer of `pipelined`: its per-device step as it is without a mesh; with one, each
  of its methods mapped over the mesh (`MeshPipelined`)."""
  return step if mesh is None else MeshPipelined(step, mesh=mesh)


def placed_grad_fn(grad_fn: Callable[..., Any], schedule: Schedule, *, mesh: Any, axis_name: Any,
                   has_aux: bool, has_state: bool, init_state: Callable[[], Any] | None = None,
                   reduction: str = "mean") -> Any:
  """The placement layer of `hooked`: its per-device `grad_fn` as it is without a mesh; with one,
  mapped over the mesh (`MeshGradFn`; `reduction` says how it combines the devices' losses)."""
  if mesh is None:
    return grad_fn
  return MeshGradFn(grad_fn, schedule, mesh=mesh, axis_name=axis_name, has_aux=has_aux, has_state=has_state,
                    init_state=init_state, reduction=reduction)


def placed(per_device: Callable[[bool], Any], *, mesh: Any, axis_name: Any, where: str) -> Any:
  """The placement layer of an optax front-end: `per_device(mean=True)` as it is (inside the user's
  pmap / shard_map) without a mesh; with one, `per_device(mean=False)` (it is given partial sums)
  mapped over the mesh (`MeshTransformation`)."""
  if mesh is None:
    return per_device(mean=True)
  return MeshTransformation(per_device(mean=False), mesh=mesh, axis_name=axis_name, where=where,
                            key=tuple(getattr(per_device, "args", ())))


