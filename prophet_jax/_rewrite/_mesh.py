"""The placement layer: the library's per-device steps inside a user's plain `jax.jit` on global arrays.

One core (`Placement`) maps a per-device callable over the mesh with the in/out specs the state layer
gives each argument's role (parameters as the plan places them, replicated inputs, the batch split over
the data axis, the library's states with each device's parts on a leading axis), after the placement
checks, with the devices' loss combined as the plain step over the global batch would. The front-ends'
mesh forms are argument adapters over it: `MeshGradFn` (`hooked`), `MeshPipelined` (`pipelined`) and
`MeshTransformation` (`scheduled`). docs/design.md ("The plain jax.jit step") says why the map is
manual over every mesh axis and what each input must be.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from . import _loss_reduction, _states
from ._pending import check_state
from ._placement import (check_batch, check_model_state, check_not_mapped, check_placed, explicit_axes, known_spec,
                         named_leaves, spec_axes, spec_entry)
from .._compiled._devices import axis_total, check_in_node, check_mesh, mesh_axis_names
from .._values._errors import AlreadyReducedError
from .._values._schedule import Schedule
from .._values._tree import is_reduced_leaf

P = PartitionSpec


def _stack(tree: Any) -> Any:
  """Each leaf with a new leading axis of 1 (per device; `P(axis)` makes it the device axis)."""
  return jax.tree_util.tree_map(lambda a: jnp.expand_dims(jnp.asarray(a), 0), tree)


class Placement:
  """The one placement core: a per-device callable mapped over `mesh` (manual over every axis).

  Each argument comes with its role: 'params' (specs from the plan: `_states.param_specs`),
  'replicated' (`P()`), 'batch' (split over the data axes on its leading axis), 'state' (the state
  layer's `state_specs`: each device's parts `P(axis)`; 'shards' for hooked's gradient shards, which
  split their 1-D shards over the axis), or 'unreduced' (gradients typed unreduced over the data axes:
  each device's partial sums); each is checked where its placement is visible, once,
  before anything is traced.

  Attributes:
    mesh: the mesh.
    axes: the data axes; `entry` their PartitionSpec entry, `n` their device count.
  """

  def __init__(self, mesh: Any, axis_name: Any, where: str, schedule: Schedule | None = None,
               reduction: str = "mean"):
    self.axes = check_mesh(mesh, axis_name, where)
    self.mesh, self.axis_name, self.where, self.schedule, self.reduction = mesh, axis_name, where, schedule, reduction
    shard = schedule.fsdp.shard_axes if schedule is not None and schedule.fsdp is not None else self.axes
    if set(self.axes) > set(shard):   # HSDP: each shard group inside one node
      check_in_node(mesh, shard, where)
    self.entry = spec_entry(self.axes)
    self.n = axis_total(mesh, self.axes)

  def spec(self, role: str, x: Any) -> Any:
    """The in_specs of an argument of `role`."""
    if role == "params":
      return _states.param_specs(x, self.schedule, self.entry)
    if role == "batch":
      return P(self.entry)
    if role in ("state", "shards"):
      return _states.state_specs(x, self.entry)
    if role == "unreduced":
      return _unreduced_specs(x, self.axes)
    return P()

  def check(self, role: str, x: Any, what: str, where: str, fix: str) -> None:
    """The placement check of an argument of `role` (`what` names it, `fix` says how to place it)."""
    if role == "batch":
      check_batch(x, self.mesh, self.axes, where)
    elif role == "state":
      check_layout(x, self.n, where, fix)
    elif role == "unreduced":
      _check_unreduced(x, self.mesh, self.axes, where)
    elif role != "shards":
      check_placed(x, self.spec(role, x), what, where, fix)

  def __call__(self, fn: Callable[..., Any], args: Sequence[tuple[str, str, Any, str]], out_specs: Any, *,
               where: str, check_vma: bool = True) -> Any:
    """`fn` mapped over the mesh and called on `args`, each `(role, what, value, fix)`."""
    check_not_mapped(self.axes, where)
    for role, what, x, fix in args:
      self.check(role, x, what, where, fix)
    in_specs = tuple(self.spec(role, x) for role, _, x, _ in args)
    mapped = jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
    values = tuple(x for _, _, x, _ in args)
    batch = [x for role, _, b, _ in args if role == "batch" for x in jax.tree_util.tree_leaves(b)]
    if batch:
      self._check_captured(mapped, values, batch, where)
    return mapped(*values)

  _seen: set = set()

  def _check_captured(self, mapped: Callable[..., Any], values: tuple, batch: list, where: str) -> None:
    """A warning when the mapped function closes over an array the size of the global batch (a loss that
    reads a batch it was not given): shard_map hands every device all of it, gathered to each."""
    key = (id(self), jax.tree_util.tree_structure(values), tuple(jax.typeof(x) for x in jax.tree_util.tree_leaves(values)))
    if key in Placement._seen:
      return
    if len(Placement._seen) > 256:
      Placement._seen.clear()
    Placement._seen.add(key)
    rows = {np.shape(x)[0] for x in batch if np.ndim(x)}
    for c in jax.make_jaxpr(mapped)(*values).consts:
      if np.ndim(c) and np.shape(c)[0] in rows and np.size(c) > 1:
        warnings.warn(
            f"{where}: loss_fn reads an array of shape {tuple(np.shape(c))} ({jax.typeof(c).dtype}) it closes "
            f"over, the global batch's size, not one given as an argument: inside the map every device gets "
            f"all of it (the compiled program gathers it to every device), so the step is not data-parallel. "
            f"Pass it as the batch: loss_fn(params, batch), called as grad_fn(params, batch).", stacklevel=4)

  def value(self, value: Any, has_aux: bool, has_state: bool, where: str) -> Any:
    """Inside the map: the loss combined over the devices as the plain step over the global batch would,
    the aux stacked per device, the new model state checked to be the same on every device."""
    if not (has_aux or has_state):
      return _loss_reduction.combine(value, self.axes, self.reduction)
    loss, rest = value
    if has_state:
      check_model_state(rest[0] if has_aux else rest, self.axes, where)
    if has_aux:
      rest = (rest[0], _stack(rest[1])) if has_state else _stack(rest)
    return _loss_reduction.combine(loss, self.axes, self.reduction), rest

  def value_specs(self, has_aux: bool, has_state: bool) -> Any:
    data = P(self.entry)
    return ((P(), (P(), data)) if has_state and has_aux else (P(), P()) if has_state else
            (P(), data) if has_aux else P())


# --------------------------------------------------------------------------------------------------
# the front-ends' adapters


class MeshGradFn:
  """`hooked(loss_fn, schedule, axis_name=..., mesh=...)`'s gradient function, on global arrays.

  `grad_fn(params, [replicated inputs such as a model state, ...,] batch) -> (loss, grads)` (aux and
  model state as `jax.value_and_grad(loss_fn, has_aux=True)` returns them; a deferring schedule's
  state last, and returned last). The loss is the one over the global batch, the gradients placed as
  the params, the aux stacked per device (docs/usage.md, "The plain jax.jit step").

  Attributes:
    mesh: the mesh.
    axis_name: the data axis.
    schedule: the schedule its collectives carry out.
  """

  def __init__(self, per_device: Callable[..., Any], *, schedule: Schedule, mesh: Any, axis_name: Any,
               has_aux: bool, has_state: bool, where: str = "hooked", init_state: Callable[[], Any] | None = None,
               reduction: str = "mean", grads_spec: Callable[[Any, Any], Any] | None = None):
    self.place = Placement(mesh, axis_name, where, schedule, reduction)
    self._fn, self._init_state, self._grads_spec = per_device, init_state, grads_spec
    self.mesh, self.axis_name, self.schedule, self.reduction = mesh, axis_name, schedule, reduction
    self._has_aux, self._has_state, self._where = has_aux, has_state, where

  def defer_state(self) -> Any:
    """The deferral state before the first step, on the mesh (None when the schedule defers nothing)."""
    return None if self._init_state is None else place_state(self._init_state, self.mesh, self.axis_name,
                                                             "defer_state")

  def defer_state_abstract(self) -> Any:
    """The per-device state before the first step, abstract (None when the step keeps none)."""
    return None if self._init_state is None else jax.eval_shape(self._init_state)

  def __call__(self, params: Any, *args: Any, **kwargs: Any) -> Any:
    where = f"{self._where}(mesh=...)'s grad_fn"
    args, defer_state, stateful = self._split_state(list(args), kwargs, where)
    if len(args) < 1 + self._has_state:
      raise TypeError(f"{where}: no batch given ({1 + len(args)} positional arguments): call grad_fn(params, "
                      f"batch), or grad_fn(params, model_state, batch) with has_state=True.")
    *reps, batch = args
    place = self.place

    def body(params, *rest):
      *reps, batch, defer_state = rest
      out = self._fn(params, *reps, batch, **({"defer_state": defer_state} if stateful else {}))
      return (place.value(out[0], self._has_aux, self._has_state, where), *out[1:])   # (value, grads[, state])

    # the step continues its own state; any other (a re-plan's) gives way to the first one
    first = self.defer_state_abstract()
    same = jax.tree_util.tree_structure(defer_state) == jax.tree_util.tree_structure(first)
    grads = self._grads_spec(place.entry, params) if self._grads_spec else place.spec("params", params)
    outs = (place.value_specs(self._has_aux, self._has_state), grads) + (
        (place.spec("state", defer_state if same else first),) if stateful else ())
    return place(body, (
        ("params", "params", params, "Place each leaf as the plan does: jax.device_put(params, NamedSharding(mesh, "
                                     "spec)), P() for a replicated one (or jax.sharding.reshard inside a jit on "
                                     "Explicit axes)."),
        *(("replicated", "model_state" if (self._has_state and i == 0) else f"input {i + 1}", r,
           "Inputs between the params and the batch are replicated: place them with P().") for i, r in enumerate(reps)),
        ("batch", "batch", batch, ""),
        ("state", "defer_state", defer_state, "Start from grad_fn.defer_state() and pass on the state each call "
                                              "returns.")), outs, where=where)

  def _split_state(self, args: list, kwargs: dict, where: str) -> tuple[list, Any, bool]:
    """(the positional inputs, the deferral state given, whether the step takes and returns one): a
    deferring step's state last (or defer_state=); else a re-plan's state, carried over, where one is given."""
    defers = self.defer_state_abstract() is not None
    state, stateful = None, True
    if "defer_state" in kwargs and (defers or _states.is_state(kwargs["defer_state"])):
      state = kwargs.pop("defer_state")
    elif len(args) >= 2 and (defers or _states.is_state(args[-1])):
      args, state = args[:-1], args[-1]
    elif defers:
      raise TypeError(f"{where}: the schedule defers, so the grad_fn takes its deferral state last: "
                      f"grad_fn(params, batch, defer_state), starting from grad_fn.defer_state().")
    else:
      stateful = False
    if kwargs:
      raise TypeError(f"{where}: unexpected keyword arguments {sorted(kwargs)}; on the mesh every "
                      f"input is positional: grad_fn(params, [replicated inputs such as the model "
                      f"state, ...,] batch).")
    return args, state, stateful


class MeshPipelined:
  """`pipelined(..., mesh=mesh)`: the pipelined step on global arrays, inside the user's `jax.jit`.

  `init`, `step`, `flush` and `deferred_grads` of the per-device step (`inner`) mapped over the mesh:
  params and model state replicated, the library's states with each device's parts on a leading axis
  (`state_specs()`), the batch split over the data axis, the loss over the global batch, the aux
  stacked per device. Every other attribute is the inner step's.

  Attributes:
    inner: the per-device `Pipelined` step.
    mesh: the mesh.
  """

  def __init__(self, inner: Any, *, mesh: Any):
    self.inner, self.mesh = inner, mesh
    self.place = Placement(mesh, inner.axis_name, "pipelined", inner.schedule, inner.reduction)

  def __getattr__(self, name: str) -> Any:  # the per-device step's fields and read-only helpers
    return getattr(self.inner, name)

  def init(self, params: Any, *model_state: Any) -> Any:
    """The global initial state (see `Pipelined.init`), mapped over the mesh."""
    fix = "Place them as the plan does: jax.device_put(params, NamedSharding(mesh, P()))."
    return self.place(self.inner.init, (("params", "params", params, fix),) + tuple(
        ("replicated", "model_state", m, "The model state is replicated: place it with P().") for m in model_state),
        self.inner.state_specs(), where="pipelined(mesh=...).init")

  def step(self, state: Any, batch: Any) -> tuple[Any, Any]:
    """One pipelined step on the global state and batch (see `Pipelined.step`): the new state and the
    loss over the global batch (with `has_aux`, `(loss, aux)`, aux stacked per device)."""
    where = "pipelined(mesh=...).step"
    check_state(state, where)
    place, inner = self.place, self.inner

    def body(state, batch):
      new, out = inner.step(state, batch)
      return new, place.value(out, inner.has_aux, False, where)

    # a state without a pending forward keeps its deferral state (a re-plan's owed values ride on)
    out = place.spec("state", state)._replace(pending=P(place.entry)) if state.pending is None else inner.state_specs()
    return place(body, (("state", "state", state, self._fix), ("batch", "batch", batch, "")),
                 (out, place.value_specs(inner.has_aux, False)), where=where)

  def flush(self, state: Any) -> Any:
    """Runs the pending backward and the scheduled update (see `Pipelined.flush`), on the mesh."""
    where = "pipelined(mesh=...).flush"
    check_state(state, where)
    if state.pending is None:
      return state
    return self.place(self.inner.flush, (("state", "state", state, self._fix),), self.inner.state_specs(),
                      where=where)

  def deferred_grads(self, state: Any) -> Any:
    """The deferred gradient values (see `Pipelined.deferred_grads`), combined over the data axis
    (replicated, like the params)."""
    where = "pipelined(mesh=...).deferred_grads"
    check_state(state, where)
    place = self.place
    return place(lambda s: _loss_reduction.combine(self.inner.deferred_grads(s), place.axes, self.inner.reduction),
                 (("state", "state", state, self._fix),), P(), where=where)

  _fix = "Start from this step's init(params), which makes the state on the mesh."


# --------------------------------------------------------------------------------------------------
# a per-device state on the mesh (any of the state layer's: each device's parts on a leading axis)


_JITTED: dict[tuple, tuple[tuple, Any]] = {}


def _jitted(kind: str, objs: tuple, key: Any, make: Callable[[], Any]) -> Any:
  """The jitted state-making shard_map for (kind, these objects by identity, key: the mesh and axis),
  made once (called eagerly, an un-jitted shard_map runs op by op on every device)."""
  full = (kind, tuple(id(o) for o in objs), key)
  hit = _JITTED.get(full)
  if hit is not None and all(a is b for a, b in zip(hit[0], objs)):
    return hit[1]
  if len(_JITTED) > 32:
    _JITTED.clear()
  fn = make()
  _JITTED[full] = (objs, fn)
  return fn


def put_on(tree: Any, mesh: Any, specs: Callable[[], Any]) -> Any:
  """`tree` placed on `mesh` with the PartitionSpecs `specs()` gives (as it is without a mesh)."""
  if mesh is None:
    return tree
  return jax.tree_util.tree_map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs())


def place_state(make: Callable[[], Any], mesh: Any, axis_name: Any, where: str) -> Any:
  """The state `make()` builds per device, laid out on the mesh: its per-device parts (`state_specs`)
  on the leading axis of global arrays split over the data axis, the rest replicated (None stays None)."""
  entry = spec_entry(check_mesh(mesh, axis_name, where))
  abstract = jax.eval_shape(make)
  if abstract is None:
    return None
  return _jitted("state", (make,), (mesh, entry), lambda: jax.jit(jax.shard_map(
      make, mesh=mesh, in_specs=(), out_specs=_states.state_specs(abstract, entry))))()


def check_layout(state: Any, n: int, where: str, fix: str) -> None:
  """ValueError when a per-device part of `state` (`_states.per_device_leaves`) is not on a leading
  axis of n devices (a state made per device, or for another device count, passed to the mesh)."""
  for name, x in _states.per_device_leaves(state):
    if np.shape(x)[:1] != (n,):
      raise ValueError(f"{where}: {name} has shape {tuple(np.shape(x))}, but on the mesh it holds each "
                       f"device's part on its leading axis ({n} devices): ({n}, ...). {fix} A state "
                       f"made for another device count converts with prophet_jax.convert_state(state, "
                       f"params, schedule, tx=tx, mesh=mesh, axis_name=...).")


def _out_specs(fn: Callable[..., Any], args: tuple, in_specs: tuple, mesh: Any, entry: Any) -> Any:
  """The out_specs of `fn` mapped over the mesh: the state layer's specs of what it returns (traced
  once, abstractly: a state's structure may change, e.g. a re-plan's deferral state carried over)."""
  shapes = jax.eval_shape(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=P(), check_vma=False),
                          *args)
  return _states.state_specs(shapes, entry)


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

  `init(params)` maps the per-device `init` over the mesh; `update(updates, state, params)` takes the
  gradients *unreduced* over the data axis (each device's partial sum of the global mean, typed
  `{U:axis}`), or a library state of per-device parts (`hooked(mesh=)`'s GradShards), and maps the
  per-device `update` (made for partial sums, `mean=False`) over the mesh: the schedule's collectives
  are the program's only gradient reduction, the update comes out replicated.
  """

  def __init__(self, per_device: Any, *, mesh: Any, axis_name: Any, where: str, key: tuple = ()):
    self.place = Placement(mesh, axis_name, where)
    self.inner, self.mesh, self.axis_name, self._where = per_device, mesh, axis_name, where
    self._key = key or (per_device,)   # what the per-device transformation is made of (its init's cache key)

  def init(self, params: Any) -> Any:
    place, inner_init = self.place, self.inner.init

    def make():   # the out_specs follow the params' structure: found while tracing, per structure
      return jax.jit(lambda p: place(inner_init, (("replicated", "params", p, self._fix),),
                                     _out_specs(inner_init, (p,), (P(),), self.mesh, place.entry),
                                     where=f"{self._where}(mesh=...).init"))

    check_not_mapped(place.axes, f"{self._where}(mesh=...).init")
    place.check("replicated", params, "params", f"{self._where}(mesh=...).init", self._fix)
    return _jitted(f"init {self._where}", self._key, (self.mesh, place.entry), make)(params)

  def update(self, updates: Any, state: Any, params: Any = None, **extra_args: Any) -> tuple[Any, Any]:
    place, where = self.place, f"{self._where}(mesh=...)"
    # per-device parts already (hooked(mesh=)'s gradient shards), or each device's partial sums
    role = "shards" if _states.is_state(updates) else "unreduced"

    body = functools.partial(self.inner.update, **extra_args)
    args = ((role, "grads", updates, ""), ("state", "optimizer state", state,
                                          "Make the optimizer state with this transformation's init on the mesh."),
            ("replicated", "params", params, self._fix))
    out = _out_specs(body, (updates, state, params), tuple(place.spec(r, x) for r, _, x, _ in args), self.mesh,
                     place.entry)
    # check_vma=False: inside, unreduced partial sums are plain per-device values
    return place(body, args, (P(), out[1]), where=where, check_vma=False)

  _fix = "Place them with jax.device_put(params, NamedSharding(mesh, P()))."


# --------------------------------------------------------------------------------------------------
# the front-ends' placement layers


def on_mesh(per_device: Any, mesh: Any, adapter: Callable[..., Any], **kwargs: Any) -> Any:
  """The placement layer of `hooked` and `pipelined`: the per-device function as it is without a mesh;
  with one, `adapter(per_device, mesh=mesh, **kwargs)` (a `MeshGradFn` or `MeshPipelined`)."""
  return per_device if mesh is None else adapter(per_device, mesh=mesh, **kwargs)


def placed(per_device: Callable[..., Any], *, mesh: Any, axis_name: Any, where: str) -> Any:
  """The placement layer of an optax front-end: `per_device(mean=True)` as it is (inside the user's
  pmap / shard_map) without a mesh; with one, `per_device(mean=False)` (it is given partial sums)
  mapped over the mesh (`MeshTransformation`)."""
  if mesh is None:
    return per_device(mean=True)
  return MeshTransformation(per_device(mean=False), mesh=mesh, axis_name=axis_name, where=where,
                            key=tuple(getattr(per_device, "args", ())))
