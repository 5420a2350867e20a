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
typed `{U:axis}`, with no all-reduce) are reduced on the schedule by `reduce_unreduced` (what
`scheduled(tx, ..., mesh=)` does in its `update`): a `shard_map` whose in_specs keep the gradients
unreduced and whose body runs the chunks' `psum`s (sums: the partial sums already carry the mean's
1/batch), so the compiled program's gradient all-reduces are the schedule's, in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from . import _accumulate, _defer, _reduction, _zero
from ._collectives import accumulated_allreduce, scheduled_allreduce
from .._values._errors import AlreadyReducedError
from .._values._schedule import Schedule
from .._values._tree import is_reduced_leaf, path_str

__all__ = ["data_axes", "check_mesh", "axis_total", "MeshGradFn", "MeshPipelined", "reduce_unreduced",
           "global_defer_state", "global_accum_state", "accumulate_unreduced", "local_devices_along",
           "sharded_init", "sharded_update"]

P = PartitionSpec


# --------------------------------------------------------------------------------------------------
# the mesh and its data axis


def data_axes(axis_name: Any) -> tuple[Any, ...]:
  """The data axis as a tuple of mesh axis names ('dp' -> ('dp',))."""
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _spec_entry(axes: tuple[Any, ...]) -> Any:
  """The PartitionSpec entry splitting one array axis over `axes` ('dp', or ('a', 'b'))."""
  return axes[0] if len(axes) == 1 else tuple(axes)


def _names(mesh: Any) -> tuple[Any, ...]:
  return tuple(mesh.axis_names)


def check_mesh(mesh: Any, axis_name: Any, where: str) -> tuple[Any, ...]:
  """The data axes, after checking that `mesh` is a mesh that has every one of them.

  Raises:
    TypeError: `mesh` is not a `jax.sharding.Mesh` / `AbstractMesh`.
    ValueError: the mesh lacks an axis of `axis_name` (its axes are named).
  """
  if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
    raise TypeError(f"{where}(mesh={mesh!r}): expected a jax.sharding.Mesh (e.g. jax.make_mesh((8,), "
                    f"({axis_name!r},))), got {type(mesh).__name__}.")
  axes = data_axes(axis_name)
  missing = [a for a in axes if a not in _names(mesh)]
  if missing:
    shape = dict(zip(_names(mesh), mesh.axis_sizes))
    raise ValueError(
        f"{where}(axis_name={axis_name!r}, mesh=...): the mesh has no axis {missing[0]!r}; its axes are "
        f"{shape}. Pass the name of the mesh axis the batch is split over (axis_name="
        f"{_names(mesh)[0]!r}?), or make the mesh with that name: jax.make_mesh((n,), ({missing[0]!r},)).")
  if len(set(axes)) != len(axes):
    raise ValueError(f"{where}(axis_name={axis_name!r}): an axis is named twice.")
  return axes


def axis_total(mesh: Any, axes: Sequence[Any]) -> int:
  """Devices along the data axes (the product of their sizes): the number of per-device batches."""
  sizes = dict(zip(_names(mesh), mesh.axis_sizes))
  return int(np.prod([sizes[a] for a in axes], dtype=np.int64))


def _explicit_axes(mesh: Any) -> frozenset[Any]:
  types = getattr(mesh, "axis_types", None) or ()
  return frozenset(n for n, t in zip(_names(mesh), types) if t == jax.sharding.AxisType.Explicit)


def _check_not_mapped(axes: tuple[Any, ...], where: str) -> None:
  """ValueError when called where the data axis is already manual (inside the user's shard_map)."""
  try:
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
  except (AttributeError, RuntimeError, ValueError):
    return
  inside = [a for a in axes if a in manual]
  if inside:
    raise ValueError(
        f"{where}: called inside a jax.shard_map (or pmap) over {inside[0]!r}, but it was made with "
        f"mesh=..., which maps over the mesh itself, for a plain jax.jit on global arrays. Inside your "
        f"own shard_map, make it without mesh= (it then works on this device's values).")


# --------------------------------------------------------------------------------------------------
# placement checks (where placement is visible)


def _known_spec(x: Any) -> PartitionSpec | None:
  """The PartitionSpec `x` is known to have, or None where that is not visible.

  Concrete arrays: from their sharding. Traced values: from their type, which carries a spec only on
  a mesh with Explicit axes (and names only those axes). Host data (numpy): None (it is placed by
  the call).
  """
  if isinstance(x, jax.core.Tracer):
    sharding = jax.typeof(x).sharding
    if not _explicit_axes(sharding.mesh):
      return None
    return sharding.spec
  if isinstance(x, jax.Array):
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding):
      return sharding.spec
    if sharding is not None and getattr(sharding, "is_fully_replicated", False):
      return P()
  return None


def _entry_axes(entry: Any) -> tuple[Any, ...]:
  if entry is None or entry is PartitionSpec.UNCONSTRAINED:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _spec_axes(spec: PartitionSpec) -> list[tuple[int, tuple[Any, ...]]]:
  """(array axis, mesh axes) for every array axis `spec` splits."""
  return [(i, _entry_axes(e)) for i, e in enumerate(spec) if _entry_axes(e)]


def _extras(spec: PartitionSpec) -> str:
  """' unreduced={...}' / ' reduced={...}' of a spec, or ''."""
  out = ""
  for name in ("unreduced", "reduced"):
    s = getattr(spec, name, None)
    if s:
      out += f" {name}={set(s)}"
  return out


def _leaves(tree: Any, prefix: str) -> list[tuple[str, Any]]:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [((f"{prefix}/{path_str(p)}" if path_str(p) else prefix), x) for p, x in flat]


def check_replicated(tree: Any, what: str, where: str, fix: str) -> None:
  """ValueError when a leaf of `tree` is known to be split (or unreduced/reduced) over any mesh axis."""
  for name, x in _leaves(tree, what):
    spec = _known_spec(x)
    if spec is None:
      continue
    split = _spec_axes(spec)
    extra = _extras(spec)
    if split or extra:
      dim, axes = split[0] if split else (None, ())
      how = (f"split over mesh axis {axes[0] if len(axes) == 1 else axes!r} on its axis {dim}" if split
             else f"typed{extra}")
      raise ValueError(
          f"{where}: {what} leaf {name!r} (shape {tuple(np.shape(x))}) is {how} (PartitionSpec "
          f"{spec}), but data parallelism needs every {what} leaf replicated, P(). {fix}")


def check_batch(batch: Any, mesh: Any, axes: tuple[Any, ...], where: str) -> None:
  """ValueError for a batch leaf that cannot be split over the data axes on its leading axis, or is
  known to be placed otherwise (replicated, split over another axis, or on another array axis)."""
  n = axis_total(mesh, axes)
  entry = _spec_entry(axes)
  leaves = _leaves(batch, "batch")
  if not leaves:
    raise ValueError(f"{where}: the batch has no array leaves; pass the global batch (leading axis: "
                     f"examples, split over {entry!r}).")
  for name, x in leaves:
    shape = tuple(np.shape(x))
    if not shape or shape[0] % n:
      raise ValueError(
          f"{where}: batch leaf {name!r} has shape {shape}; every batch leaf needs a leading (example) "
          f"axis that splits over mesh axis {entry!r} ({n} devices), e.g. ({4 * n}, ...). Values that "
          f"are the same for the whole batch (a PRNG key, a step number) belong in the model state "
          f"(has_state=True) or in loss_fn's closure.")
    spec = _known_spec(x)
    if spec is None:
      if set(axes) & _explicit_axes(mesh):   # jax's shard_map would refuse it, naming only in_specs
        what = "host data (numpy), not placed on the mesh" if not isinstance(x, jax.Array) else (
            "not placed on the mesh (its type names no mesh axis)")
        raise ValueError(
            f"{where}: batch leaf {name!r} (shape {shape}) is {what}, but the mesh's axis {entry!r} is "
            f"Explicit, so the batch must arrive split over it: jax.device_put(batch, NamedSharding(mesh, "
            f"P({entry!r}))) before the step (outside the jit).")
      continue
    split = _spec_axes(spec)
    lead = _entry_axes(spec[0]) if len(spec) else ()
    if tuple(lead) != axes or len(split) != 1 or _extras(spec):
      now = "replicated (not split over any axis)" if not split else f"placed as {spec}"
      raise ValueError(
          f"{where}: batch leaf {name!r} (shape {shape}) is {now}, but the batch must be split over "
          f"mesh axis {entry!r} on its leading axis and nothing else: "
          f"jax.device_put(batch, NamedSharding(mesh, P({entry!r}))) before the step (or, inside a "
          f"jit on Explicit axes, jax.sharding.reshard(x, P({entry!r}))).")


def _check_defer_layout(defer_state: Any, n: int, where: str, fix: str) -> None:
  if not isinstance(defer_state, _defer.DeferState):
    return  # _defer.check_state names what is wrong, inside the map
  for gi, r in enumerate(defer_state.residual):
    if np.shape(r)[:1] != (n,):
      raise ValueError(
          f"{where}: the deferral state's residual of group {gi} has shape {tuple(np.shape(r))}, but on "
          f"the mesh it holds each device's residual on its leading axis ({n} devices): "
          f"({n}, ...). {fix}")


def _varying_over(x: Any, axes: tuple[Any, ...]) -> bool:
  varying = jax.typeof(x).manual_axis_type.varying
  return any(a in varying for a in axes)


def _stack(tree: Any) -> Any:
  """Each leaf with a new leading axis of 1 (per device; `P(axis)` makes it the device axis)."""
  return jax.tree_util.tree_map(lambda a: jnp.expand_dims(jnp.asarray(a), 0), tree)


def _check_model_state(new: Any, axes: tuple[Any, ...], where: str) -> None:
  for name, x in _leaves(new, "model_state"):
    if hasattr(x, "dtype") and _varying_over(x, axes):
      entry = _spec_entry(axes)
      raise ValueError(
          f"{where}: the new model state's leaf {name!r} varies over mesh axis {entry!r} (it was "
          f"computed from each device's own batch), but on the mesh the model state is one value, "
          f"replicated, as in a plain jax.jit step. Average it over the axis in loss_fn: "
          f"jax.lax.pmean(..., {entry!r}) (flax: nn.BatchNorm(axis_name={entry!r}), which is what a "
          f"plain jax.jit step over the global batch computes).")


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
               has_aux: bool, has_state: bool, where: str = "hooked", reduction: str = "mean"):
    self._axes = check_mesh(mesh, axis_name, where)
    self._fn = per_device
    self.reduction = reduction
    self.mesh = mesh
    self.axis_name = axis_name
    self.schedule = schedule
    self._has_aux = has_aux
    self._has_state = has_state
    self._where = where

  def defer_state(self) -> _defer.DeferState | None:
    """The deferral state before the first step, on the mesh (None when the schedule defers nothing):
    each device's (zero) residual on the leading axis, `P(axis_name)`, the rest replicated."""
    return global_defer_state(self.schedule, self.mesh, self.axis_name)

  def deferred_grads(self, defer_state: Any, params: Any) -> Any:
    """The deferred gradient values in `defer_state` (this grad_fn's, on the mesh), combined over the
    data axis (the mean; the sum with reduction='sum'), as a replicated tree like `params` (zeros
    when nothing is deferred): apply them with `tx` at the end of training, as `MeshPipelined` does."""
    where = f"{self._where}(mesh=...)'s grad_fn.deferred_grads"
    entry = _spec_entry(self._axes)
    if defer_state is not None:
      _check_defer_layout(defer_state, axis_total(self.mesh, self._axes), where,
                          "Pass the state this grad_fn returned (it starts from grad_fn.defer_state()).")
    specs = _defer.state_specs(defer_state, entry) if defer_state is not None else P()
    body = lambda s, p: _reduction.combine(_defer.deferred_grads(s, p), self._axes, self.reduction)  # noqa: E731
    # jitted: un-jitted, a shard_map runs op by op on every device
    return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(specs, P()), out_specs=P()))(defer_state, params)

  def _value_specs(self) -> Any:
    data = P(_spec_entry(self._axes))
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
    stateful = self.schedule.defers
    if self.schedule.defers:
      if "defer_state" in kwargs:
        defer_state = kwargs.pop("defer_state")
      elif len(args) >= 2:
        defer_state = args.pop()
      else:
        raise TypeError(f"{where}: the schedule defers, so the grad_fn takes its deferral state last: "
                        f"grad_fn(params, batch, defer_state), starting from grad_fn.defer_state().")
    elif isinstance(kwargs.get("defer_state"), _defer.DeferState) or (
        len(args) >= 2 and isinstance(args[-1], _defer.DeferState)):   # a re-plan's state, carried over
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
    _check_not_mapped(axes, where)
    fix_params = ("Place them with jax.device_put(params, NamedSharding(mesh, P())) (or "
                  "jax.sharding.reshard(params, P()) inside a jit on Explicit axes).")
    check_replicated(params, "params", where, fix_params)
    for i, r in enumerate(reps):
      check_replicated(r, "model_state" if (self._has_state and i == 0) else f"input {i + 1}", where,
                       "Inputs between the params and the batch are replicated: place them with P().")
    check_batch(batch, self.mesh, axes, where)
    n = axis_total(self.mesh, axes)
    if defer_state is not None:
      _check_defer_layout(defer_state, n, where, "Start from grad_fn.defer_state() and pass on the state "
                          "each call returns.")
    data = P(_spec_entry(axes))

    def body(params, reps, batch, defer_state):
      extra = {"defer_state": defer_state} if stateful else {}
      out = self._fn(params, *reps, batch, **extra)
      value, grads = out[0], out[1]
      if self._has_aux or self._has_state:
        loss, rest = value
        if self._has_state and self._has_aux:
          new_state, aux = rest
          _check_model_state(new_state, axes, where)
          rest = (new_state, _stack(aux))
        elif self._has_state:
          _check_model_state(rest, axes, where)
        else:
          rest = _stack(rest)
        value = (_reduction.combine(loss, axes, self.reduction), rest)
      else:
        value = _reduction.combine(value, axes, self.reduction)
      return (value, grads, out[2]) if stateful else (value, grads)

    dspec = _defer.state_specs(defer_state, _spec_entry(axes)) if defer_state is not None else P()
    out_state = defer_state if _defer.belongs(defer_state, self.schedule) else _defer.init(self.schedule)
    dspec_out = _defer.state_specs(out_state, _spec_entry(axes)) if out_state is not None else P()
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
    return _spec_entry(self._axes)

  def init(self, params: Any, *model_state: Any) -> Any:
    """The global initial state (see `Pipelined.init`), mapped over the mesh."""
    where = "pipelined(mesh=...).init"
    _check_not_mapped(self._axes, where)
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
    self.inner._check_state(state, where)
    _check_not_mapped(self._axes, where)
    check_replicated(state.params, "params", where, "Start from this step's init(params).")
    check_batch(batch, self.mesh, self._axes, where)
    self._check_global_defer(state, where)
    specs = self.inner.state_specs()
    data = P(self._entry)

    def body(state, batch):
      new, out = self.inner.step(state, batch)
      if self.inner.has_aux:
        loss, aux = out
        return new, (_reduction.combine(loss, self._axes, self.inner.reduction), _stack(aux))
      return new, _reduction.combine(out, self._axes, self.inner.reduction)

    value_spec = (P(), data) if self.inner.has_aux else P()
    return jax.shard_map(body, mesh=self.mesh, in_specs=(specs, data),
                         out_specs=(specs, value_spec))(state, batch)

  def flush(self, state: Any) -> Any:
    """Runs the pending backward, its all-reduces and the update (see `Pipelined.flush`), on the mesh."""
    where = "pipelined(mesh=...).flush"
    self.inner._check_state(state, where)
    if state.pending is None:
      return state
    _check_not_mapped(self._axes, where)
    self._check_global_defer(state, where)
    specs = self.inner.state_specs()
    return jax.shard_map(self.inner.flush, mesh=self.mesh, in_specs=(specs,), out_specs=specs)(state)

  def deferred_grads(self, state: Any) -> Any:
    """The deferred gradient values, averaged over the data axis, as a replicated tree like the params
    (zeros when nothing is deferred): apply them with `tx` at the end of training if wanted."""
    where = "pipelined(mesh=...).deferred_grads"
    self.inner._check_state(state, where)
    self._check_global_defer(state, where)
    return jax.shard_map(lambda s: _reduction.combine(self.inner.deferred_grads(s), self._axes,
                                                      self.inner.reduction),
                         mesh=self.mesh, in_specs=(self.inner.state_specs(),), out_specs=P())(state)

  def _check_global_defer(self, state: Any, where: str) -> None:
    if state.defer is not None:
      _check_defer_layout(state.defer, axis_total(self.mesh, self._axes), where,
                          "Start from this step's init(params), which makes the state on the mesh.")


# --------------------------------------------------------------------------------------------------
# the deferral state on the mesh


_JITTED: dict[tuple, tuple[tuple, Any]] = {}


def _jitted(kind: str, objs: tuple, mesh: Any, make: Callable[[], Any]) -> Any:
  """The jitted state-making shard_map for (kind, these objects by identity, (mesh, axis)), made once.

  Called eagerly (`TrainState.create`, `nnx.Optimizer`), an un-jitted shard_map runs its body op by op
  on every device (seconds per call on a small host); jitted once, a call is a cache hit; inside the
  user's jit it is inlined."""
  key = (kind, tuple(id(o) for o in objs), mesh)
  hit = _JITTED.get(key)
  if hit is not None and all(a is b for a, b in zip(hit[0], objs)):
    return hit[1]
  if len(_JITTED) > 32:
    _JITTED.clear()
  fn = make()
  _JITTED[key] = (objs, fn)
  return fn


def global_defer_state(schedule: Schedule, mesh: Any, axis_name: Any) -> _defer.DeferState | None:
  """`prophet_jax.defer_state(schedule)` laid out on the mesh: residuals `(n, k, c)` split over the
  data axis (each device's own, zero), the rest replicated; None when the schedule defers nothing."""
  if not schedule.defers:
    return None
  axes = check_mesh(mesh, axis_name, "defer_state")
  abstract = _defer.init(schedule)
  specs = _defer.state_specs(abstract, _spec_entry(axes))
  return _jitted("defer", (schedule,), (mesh, _spec_entry(axes)), lambda: jax.jit(jax.shard_map(
      lambda: _defer.init(schedule), mesh=mesh, in_specs=(), out_specs=specs)))()


# --------------------------------------------------------------------------------------------------
# gradients obtained unreduced: reduced on the schedule


def _check_unreduced(grads: Any, mesh: Any, axes: tuple[Any, ...], where: str) -> None:
  entry = _spec_entry(axes)
  how = (f"differentiate with respect to params resharded to P(reduced={{{entry!r}}}) "
         f"(jax.sharding.reshard(p, P(*[None] * p.ndim, reduced={{{entry!r}}})) for every leaf, before "
         f"jax.grad), so that jax.grad leaves each device's partial sum unreduced")
  if not set(axes) <= _explicit_axes(mesh):
    raise ValueError(
        f"{where}: gradients obtained unreduced need mesh axes of type Explicit (jax.make_mesh's "
        f"default; this mesh's are {dict(zip(_names(mesh), mesh.axis_types))}), where the type says "
        f"they are unreduced. With Auto axes use prophet_jax.hooked(loss_fn, schedule, "
        f"axis_name={entry!r}, mesh=mesh), which issues the chunks inside backward itself.")
  for name, g in _leaves(grads, "grads"):
    if not is_reduced_leaf(g) or np.size(g) == 0:
      continue
    spec = jax.typeof(g).sharding.spec if isinstance(g, jax.core.Tracer) else _known_spec(g)
    unreduced = set(getattr(spec, "unreduced", ()) or ()) if spec is not None else set()
    if not set(axes) <= unreduced:
      if spec is not None and not _spec_axes(spec) and not unreduced:
        raise AlreadyReducedError(
            f"{where}: gradient {name!r} is replicated (type {jax.typeof(g)}): jax.grad already "
            f"all-reduced it over {entry!r} (the plain jit step's own all-reduce), and reducing it "
            f"again would be {axis_total(mesh, axes)} times too large. Obtain the gradients unreduced "
            f"instead: {how}; or use prophet_jax.hooked(loss_fn, schedule, axis_name={entry!r}, "
            f"mesh=mesh), which reduces them inside backward.")
      raise ValueError(
          f"{where}: gradient {name!r} (type {jax.typeof(g)}) is not unreduced over mesh axis "
          f"{entry!r}: the gradients must be each device's partial sums, typed {{U:{entry}}}: {how}.")


def reduce_unreduced(grads: Any, schedule: Schedule, *, mesh: Any, axis_name: Any, where: str,
                     defer_state: Any = None) -> tuple[Any, Any]:
  """Gradients unreduced over the data axis (global arrays typed `{U:axis}`), reduced on the schedule.

  Returns (the replicated gradients, the new deferral state or None). The chunks' `psum`s are sums:
  each device's partial sum already carries the loss's mean over the global batch.
  """

  axes = check_mesh(mesh, axis_name, where)
  _check_not_mapped(axes, where)
  _check_unreduced(grads, mesh, axes, where)
  entry = _spec_entry(axes)
  n = axis_total(mesh, axes)
  if defer_state is not None:
    _check_defer_layout(defer_state, n, where, "Make the optimizer state with this transformation's "
                        "init on the mesh (its deferral residuals then have that leading axis).")

  def spec_of(g):
    spec = jax.typeof(g).sharding.spec
    return spec if set(axes) <= set(getattr(spec, "unreduced", ()) or ()) else P()

  gspecs = jax.tree_util.tree_map(spec_of, grads)
  dspec = _defer.state_specs(defer_state, entry) if defer_state is not None else P()
  dspec_out = dspec
  if defer_state is not None and not _defer.belongs(defer_state, schedule):   # a re-plan's state: carried
    new = _defer.init(schedule)
    dspec_out = _defer.state_specs(new, entry) if new is not None else P()

  def body(g, d):
    red, new = scheduled_allreduce(g, schedule, axes if len(axes) > 1 else axes[0], mean=False,
                                   where=where, defer_state=d)
    return red, new

  # check_vma=False: inside, the partial sums are plain per-device values (jax has no cast from
  # unreduced to varying); psum of them is the reduction, as under pmap
  mapped = jax.shard_map(body, mesh=mesh, in_specs=(gspecs, dspec), out_specs=(P(), dspec_out),
                         check_vma=False)
  return mapped(grads, defer_state)


def global_accum_state(schedule: Schedule, mesh: Any, axis_name: Any) -> _accumulate.AccumState:
  """`scheduled(..., every_k=k)`'s gradient accumulator laid out on the mesh: each row's sums `(n,
  *shape)` split over the data axis (each device's own, zero), the count replicated."""
  axes = check_mesh(mesh, axis_name, "scheduled")
  specs = _defer.state_specs(_accumulate.init(schedule), _spec_entry(axes))
  return _jitted("accum", (schedule,), (mesh, _spec_entry(axes)), lambda: jax.jit(jax.shard_map(
      lambda: _accumulate.init(schedule), mesh=mesh, in_specs=(), out_specs=specs)))()


def accumulate_unreduced(grads: Any, schedule: Schedule, *, mesh: Any, axis_name: Any, where: str,
                         every_k: int, accum: Any, defer_state: Any = None) -> tuple[Any, Any, Any, Any]:
  """Gradients unreduced over the data axis, accumulated per device and reduced on the schedule once
  per `every_k` calls (`_collectives.accumulated_allreduce` on each device's partial sums, inside one
  `shard_map`). Returns (the replicated reduced gradients on the k-th call, zeros otherwise; the new
  deferral state or None; the new accumulator; whether this call reduced, replicated)."""
  axes = check_mesh(mesh, axis_name, where)
  _check_not_mapped(axes, where)
  _check_unreduced(grads, mesh, axes, where)
  entry = _spec_entry(axes)
  n = axis_total(mesh, axes)
  fix = "Make the optimizer state with this transformation's init on the mesh."
  if defer_state is not None:
    _check_defer_layout(defer_state, n, where, fix)
  if isinstance(accum, _accumulate.AccumState):
    for (path, _, _), g in zip(schedule.rows, accum.grads):
      if np.shape(g)[:1] != (n,):
        raise ValueError(
            f"{where}: the gradient accumulator's sum for {path!r} has shape {tuple(np.shape(g))}, but on "
            f"the mesh it holds each device's sum on its leading axis ({n} devices): ({n}, ...). {fix}")

  def spec_of(g):
    spec = jax.typeof(g).sharding.spec
    return spec if set(axes) <= set(getattr(spec, "unreduced", ()) or ()) else P()

  gspecs = jax.tree_util.tree_map(spec_of, grads)
  dspec = _defer.state_specs(defer_state, entry) if defer_state is not None else P()
  aspec = _defer.state_specs(accum, entry)

  def body(g, a, d):
    return accumulated_allreduce(g, schedule, axes if len(axes) > 1 else axes[0], every_k=every_k,
                                 accum=a, mean=False, where=where, defer_state=d)

  # check_vma=False, as in reduce_unreduced: inside, the partial sums are plain per-device values
  mapped = jax.shard_map(body, mesh=mesh, in_specs=(gspecs, aspec, dspec),
                         out_specs=(P(), dspec, aspec, P()), check_vma=False)
  return mapped(grads, accum, defer_state)


# --------------------------------------------------------------------------------------------------
# a sharded schedule (ZeRO-1) on the mesh: the shard state is a global array split over the axis


def sharded_init(tx: Any, params: Any, schedule: Schedule, *, mesh: Any, axis_name: Any) -> Any:
  """`scheduled(tx, sharded_schedule, mesh=)`'s state: `_zero.init` on every device of the mesh, each
  device's shard state on the leading axis of global arrays split over the data axis (`P(axis)`)."""
  where = "scheduled(mesh=...).init"
  axes = check_mesh(mesh, axis_name, where)
  _check_not_mapped(axes, where)
  check_replicated(params, "params", where, "Place them with jax.device_put(params, NamedSharding(mesh, "
                   "P())).")
  entry = _spec_entry(axes)
  ax = axes if len(axes) > 1 else axes[0]
  return _jitted("sharded", (tx, schedule), (mesh, entry), lambda: jax.jit(jax.shard_map(
      lambda p: _zero.init(tx, p, schedule, ax, where), mesh=mesh, in_specs=P(), out_specs=P(entry))))(params)


def sharded_update(tx: Any, updates: Any, state: Any, params: Any, schedule: Schedule, *, mesh: Any,
                   axis_name: Any, extra_args: dict | None = None) -> tuple[Any, Any]:
  """`scheduled(tx, sharded_schedule, mesh=)`'s update on global arrays: the gradients unreduced over
  the data axis (reduce-scattered here, summed: the partial sums carry the mean) or the GradShards of
  `hooked(..., mesh=)` (split over the axis); `tx` on each device's shard; the update all-gathered,
  returned replicated (`P()`), with the new shard state (`P(axis)`)."""
  where = "scheduled(mesh=...)"
  axes = check_mesh(mesh, axis_name, where)
  _check_not_mapped(axes, where)
  entry = _spec_entry(axes)
  ax = axes if len(axes) > 1 else axes[0]
  n = axis_total(mesh, axes)
  if not isinstance(state, _zero.ShardedState):
    _zero.check_state(state, schedule, n, where)
  lead = [np.shape(x)[:1] for x in jax.tree_util.tree_leaves(state.per_device)]
  if any(s != (n,) for s in lead):
    raise ValueError(f"{where}: the sharded optimizer state's leaves have leading axes {sorted(set(lead))}, "
                     f"but on the mesh each device's shard state is on a leading axis of {n} (the data "
                     f"axis): make the state with this transformation's init on the mesh.")
  if isinstance(updates, _zero.GradShards):
    gspecs, mean = P(entry), True
  else:
    _check_unreduced(updates, mesh, axes, where)

    def spec_of(g):
      spec = jax.typeof(g).sharding.spec
      return spec if set(axes) <= set(getattr(spec, "unreduced", ()) or ()) else P()

    gspecs, mean = jax.tree_util.tree_map(spec_of, updates), False

  def body(g, st, p):
    return _zero.update(tx, g, st, p, schedule, ax, where=where, mean=mean, extra_args=extra_args)

  # check_vma=False: inside, unreduced partial sums are plain per-device values (see reduce_unreduced)
  mapped = jax.shard_map(body, mesh=mesh, in_specs=(gspecs, P(entry), P()), out_specs=(P(), P(entry)),
                         check_vma=False)
  return mapped(updates, state, params)


# --------------------------------------------------------------------------------------------------
# profiling on the mesh


def local_devices_along(mesh: Any, axis_name: Any, where: str) -> list[Any]:
  """This process's devices along the data axes of `mesh` (at the first index of every other axis):
  the devices a per-device profile of the mesh's step runs on."""
  axes = check_mesh(mesh, axis_name, where)
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"{where}(mesh=...): profiling runs the step, so it needs a mesh of real devices "
                    f"(jax.sharding.Mesh), not {type(mesh).__name__}.")
  names = _names(mesh)
  devices = np.asarray(mesh.devices)
  index = tuple(slice(None) if n in axes else 0 for n in names)
  along = devices[index]
  order = [n for n in names if n in axes]
  along = np.transpose(along, [order.index(a) for a in axes]).reshape(-1)
  here = jax.process_index()
  out = [d for d in along if d.process_index == here]
  if not out:
    raise ValueError(f"{where}(mesh=...): none of the mesh's devices along {axes} belongs to this "
                     f"process.")
  return out
