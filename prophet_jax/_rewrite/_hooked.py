"""`hooked` and its hooks: a Schedule carried out inside the backward pass of the user's own step.

- `hooked(loss_fn, schedule, axis_name=...)` returns `grad_fn(params, batch) -> (loss, grads)` whose
  all-reduces run *inside* the backward pass: each group of chunks is issued from the backward rule of a
  `custom_vjp` identity on its parameters, as soon as their gradients exist, and a scalar token threaded
  through the hooks keeps the issue order of the schedule in the compiled program.
- `loop_hook(tree, name=...)` is the model-side helper for scan-over-layers models: applied to a layer's
  params inside the scanned body (e.g. through `flax.linen.map_variables`), it all-reduces that layer's
  gradients inside the backward loop, one trip per layer, when the step runs under `hooked(...,
  in_loop=(...))`; elsewhere it is the identity.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from . import _loss_reduction, _mesh
from ._axis import is_varying, to_varying
from ._collectives import reduce_units, schedule_units, unit_allreduces, zero_of
from ._sharded import reduce_scatter_chunks
from ._fsdp_step import fsdp_grad
from ._fsdp_units import split_axes
from ._defer import GroupState, deferred_grads, group_states, init as defer_init, with_groups
from ._keys import check_enforce_order, ordered_by
from ._reduction import step_setup
from ._states import GradShards, is_state
from ._zero import shard_tag
from .._values._checks import check_values
from .._values._schedule import Bucket, Chunk, Schedule, shard_size
from .._values._tree import dtype_name, is_float_dtype, is_reduced_leaf

LOOP_SCOPE = "prophet/loop/"


# --------------------------------------------------------------------------------------------------
# hooked: all-reduces inside the backward pass


def hook_groups(units: Sequence[Any]) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
  """Splits the issued units into hook groups: (first unit, end unit, rows), in issue order.

  The units are `_collectives.schedule_units(schedule)`: each chunk of a lossless bucket, and each
  deferral group (`Bucket.defer > 0`, whose chunks are ranked and reduced together) as one unit; for a
  lossless schedule they are its chunks. A hook fires when all of its parameters' gradients exist, so
  a unit must live in the hook of every row it touches: units sharing a row share a group, and groups
  are contiguous ranges of the issue order (so the token keeps the order of the schedule exactly).
  Typical schedules give one group per chunk (merged leaves) or one group per leaf (a leaf split into
  partitions).
  """
  groups: list[list[Any]] = []  # [start, end, set(rows)]
  for k, unit in enumerate(units):
    rows = set(unit.rows) if isinstance(unit, Chunk) else {r for c in unit.chunks for r in c.rows}
    hit = next((j for j, g in enumerate(groups) if g[2] & rows), None)
    if hit is None:
      groups.append([k, k + 1, rows])
    else:
      merged = set(rows)
      for g in groups[hit:]:
        merged |= g[2]
      groups[hit:] = [[groups[hit][0], k + 1, merged]]
  return tuple((a, b, tuple(sorted(r))) for a, b, r in groups)


def _encode(g: GroupState) -> tuple[jax.Array, ...]:
  """A deferral group's state as floats, so it can be a custom_vjp primal input whose "cotangent" the
  backward rule sets to the new state (an int or bool input only takes a float0 cotangent). The chunk
  numbers and the mask are small integers: exact in float32."""
  return (g.norms, g.deferred.astype(jnp.float32), g.index.astype(jnp.float32), g.residual)


def _decode(x: Sequence[jax.Array]) -> GroupState:
  norms, deferred, index, residual = x
  return GroupState(norms=norms, deferred=deferred > 0.5, index=index.astype(jnp.int32), residual=residual)


def _relabel(c: Chunk, local: Mapping[int, int]) -> Chunk:
  """`c` with its rows renumbered to a hook's own leaves (`local`: schedule row -> the hook's index)."""
  return Chunk(slices=tuple((local[r], a, b) for r, a, b in c.slices), dtype=c.dtype)


def _local(units: Sequence[Any], rows: Sequence[int]) -> tuple[Any, ...]:
  """`units` (chunks, deferral groups) with their rows renumbered to a hook's own leaves."""
  local = {r: i for i, r in enumerate(rows)}
  return tuple(_relabel(u, local) if isinstance(u, Chunk) else
               dataclasses.replace(u, chunks=tuple(_relabel(c, local) for c in u.chunks)) for u in units)


class Collective(NamedTuple):
  """What one hook group issues in backward (`HookPlan.backward`): the all-reduces of its units (chunks
  and deferral groups, `reduce_units`) or the reduce-scatters of its chunks (a ZeRO-1 plan), from the
  unit index `first` on."""

  kind: str                  # "all-reduce" or "reduce-scatter"
  units: tuple[Any, ...]     # chunks or deferral groups, their rows renumbered to the group's leaves
  first: int                 # the first unit's index (its named scope)
  extra: tuple[int, ...]     # what the hook carries beside its leaves: deferral groups, or the chunks' slots


class HookPlan(NamedTuple):
  """The hooks of a schedule, built once: per group of leaves, in issue order, what forward gathers
  (nothing for today's families: the params are whole) and what backward reduces."""

  forward: tuple[tuple[tuple[int, ...], Any], ...]
  backward: tuple[tuple[tuple[int, ...], Collective], ...]
  family: str


def hook_plan(schedule: Schedule) -> HookPlan:
  """The schedule's groups of leaves with their collectives: for an all-reduce or ZeRO-1 plan the hook
  groups (`hook_groups`) with what their backward rules issue; for an FSDP plan the all-gather groups
  forward issues (which may differ from the units) and, per chunk, backward's reduce-scatter of a unit
  or all-reduce of replicated leaves (`_fsdp_step` carries them out)."""
  if schedule.family == "fsdp":
    f, chunks = schedule.fsdp, schedule.chunks
    rows = lambda k: tuple(dict.fromkeys(r for r, _, _ in chunks[k].slices))  # noqa: E731
    groups = f.gathers or tuple(rows(u) for u in f.units)
    return HookPlan(forward=tuple((g, "all-gather") for g in groups), family="fsdp", backward=tuple(
        (rows(k), Collective("reduce-scatter" if k in f.units else "all-reduce", (chunks[k],), k, ()))
        for k in range(len(chunks))))
  units = schedule_units(schedule)
  firsts = np.concatenate([[0], np.cumsum([unit_allreduces(u) for u in units])]).astype(int).tolist()
  backward, seen = [], 0
  for a, b, rows in hook_groups(units):
    if schedule.family == "zero1":
      col = Collective("reduce-scatter", _local(units[a:b], rows), a, tuple(range(a, b)))
    else:
      n_groups = sum(isinstance(u, Bucket) for u in units[a:b])
      col = Collective("all-reduce", _local(units[a:b], rows), firsts[a], tuple(range(seen, seen + n_groups)))
      seen += n_groups
    backward.append((rows, col))
  return HookPlan(forward=(), backward=tuple(backward), family=schedule.family)


def _make_hook(col: Collective, cast: Sequence[bool], avals: Sequence[tuple[tuple[int, ...], Any]],
               axis_name: Any, n: int, divisor: Any) -> Callable:
  """A custom_vjp identity on (a hook group's leaves, token, extra) whose backward issues `col`.

  Forward: the leaves (cast to varying where `cast` says, so that under check_vma their cotangents
  stay per-device) and the token, unchanged; `extra` is an input only. Backward: the group's
  collectives, the first tied to the incoming token cotangent; the token's cotangent is tied to the
  last result; `extra`'s cotangent carries what backward made: the deferral groups' new states
  (encoded, `_encode`) or the reduce-scattered shards (the leaves' cotangents are zeros then: nothing
  reads the full gradients).
  """
  row_leaf = tuple(range(len(cast)))

  def backward(ct_leaves, ct_token, extra):
    if col.kind == "reduce-scatter":
      shards, last = reduce_scatter_chunks(ct_leaves, col.units, row_leaf, axis_name, n=n, divisor=divisor,
                                           first_index=col.first, prev=ct_token)
      return [jnp.zeros(s, d) for s, d in avals], last, tuple(shards)
    out, last, new = reduce_units(ct_leaves, col.units, row_leaf, axis_name, divisor=divisor,
                                  first_index=col.first, prev=ct_token, defer=tuple(_decode(x) for x in extra))
    return out, last, tuple(_encode(g) for g in new)

  @jax.custom_vjp
  def hook(leaves, token, extra):
    return [(to_varying(x, axis_name) if c else x) for x, c in zip(leaves, cast)], token

  def fwd(leaves, token, extra):
    return hook(leaves, token, extra), extra

  def bwd(extra, cts):
    ct_leaves, ct_token = cts
    out, last, extra_ct = backward(list(ct_leaves), ct_token, extra)
    return out, zero_of(last, ct_token.dtype), extra_ct

  hook.defvjp(fwd, bwd)
  return hook


_LOOP_AXIS: contextvars.ContextVar[Any] = contextvars.ContextVar("prophet_loop_axis", default=None)


@contextlib.contextmanager
def _loop_axis(axis_name: Any, divisor: int, vma: bool, calls: list[str]):
  tok = _LOOP_AXIS.set((axis_name, divisor, vma, calls))
  try:
    yield
  finally:
    _LOOP_AXIS.reset(tok)


def loop_hook(tree: Any, *, name: str = "layer") -> Any:
  """Model-side helper: all-reduce `tree`'s gradients inside a scanned body's backward pass.

  Apply it to one layer's params *inside* the body of `jax.lax.scan` / `flax.linen.scan` (for linen,
  wrap the scanned module: `nn.map_variables(Block, "params", trans_in_fn=lambda p: loop_hook(p),
  init=True)`). When the step runs under `hooked(..., in_loop=(path prefix of the scanned params,))`,
  the body's backward then all-reduces that layer's gradients (one all-reduce per dtype, labelled
  `prophet/loop/<name>`) on every trip of the backward loop, right after the layer's weight
  gradients exist, which a loss-level hook or `scheduled` cannot do (their all-reduces run after the
  loop ends). Outside `hooked` (init, evaluation, a plain `jax.grad`) it is the identity.

  Args:
    tree: the layer's params (one scan slice).
    name: a label for the all-reduce's named scope.

  Returns:
    `tree`, unchanged in value.
  """
  ctx = _LOOP_AXIS.get()
  if ctx is None:
    return tree
  axis_name, divisor, vma, calls = ctx
  calls.append(name)
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  idx = [i for i, x in enumerate(leaves) if is_reduced_leaf(x) and np.size(x) > 0]
  if not idx:
    return tree
  sel = [leaves[i] for i in idx]
  dtypes = list(dict.fromkeys(dtype_name(x.dtype) for x in sel))
  chunks = []
  for dt in dtypes:
    chunks.append(Chunk(slices=tuple((j, 0, int(np.size(x))) for j, x in enumerate(sel)
                                     if dtype_name(x.dtype) == dt), dtype=dt))
  row_leaf = tuple(range(len(sel)))
  cast = [vma and not is_varying(x, axis_name) for x in sel]

  @jax.custom_vjp
  def hook(xs):
    return [(to_varying(x, axis_name) if c else x) for x, c in zip(xs, cast)]

  def fwd(xs):
    return hook(xs), None

  def bwd(_, cts):
    out, _, _ = reduce_units(list(cts), chunks, row_leaf, axis_name, divisor=divisor,
                             scope=f"{LOOP_SCOPE}{name}")
    return (out,)

  hook.defvjp(fwd, bwd)
  new = hook(sel)
  for i, x in zip(idx, new):
    leaves[i] = x
  return jax.tree_util.tree_unflatten(treedef, leaves)


_NO_STATE = object()


def _check_loss_output(out: Any, has_aux: bool, has_state: bool) -> Any:
  """The loss in `loss_fn`'s output (`_loss_reduction.split_output`), a real floating scalar."""
  loss = _loss_reduction.split_output(out, has_aux, has_state, "hooked")[0]
  shape = np.shape(loss)
  if shape != () or not is_float_dtype(getattr(loss, "dtype", np.float32)):
    raise TypeError(f"hooked: the loss must be a real floating scalar to be differentiated; loss_fn "
                    f"returned {getattr(loss, 'dtype', type(loss).__name__)}{tuple(shape)}. Reduce it to a "
                    f"scalar (e.g. .mean()) and return other values as aux (has_aux=True).")
  return loss


def hooked(loss_fn: Callable[..., Any], schedule: Schedule, *, axis_name: str | tuple[str, ...],
           has_aux: bool = False, has_state: bool = False, in_loop: Sequence[str] = (),
           mesh: Any = None, reduction: str = "mean", enforce_order: bool = True) -> Callable[..., Any]:
  """`grad_fn(params, batch) -> (loss, grads)` whose collectives run inside the backward pass.

  Each group of the plan's units is issued from the backward rule of a `custom_vjp` identity on its
  parameters, as soon as their gradients exist; a token threaded through the hooks keeps the plan's
  order in the compiled program. The gradients come back averaged over `axis_name` (pair them with a
  plain `tx`). Under `shard_map` the hooks mark replicated params varying themselves (do not `pcast`).
  A sharded plan (`dear`) returns this device's `GradShards` for `scheduled(tx, schedule)`; a
  deferring plan takes and returns its deferral state (`grad_fn(params, batch, defer_state)`); an
  FSDP plan takes and returns the parameters' shards, gathering each group in forward
  (docs/design.md, "FSDP in the user's step"). With `mesh=`, `grad_fn` runs on global arrays inside
  a plain `jax.jit` (docs/usage.md, "The plain jax.jit step"): `loss_fn` then runs per device on its
  slice of the batch and must be a mean (or, `reduction="sum"`, a sum) over its examples.

  Args:
    loss_fn: `loss_fn(params, batch) -> loss` (`(loss, aux)` with `has_aux`; `loss_fn(params,
      model_state, batch) -> (loss, new_model_state)` with `has_state`; both: `(loss, (state, aux))`).
    schedule: the Schedule to carry out; its rows are the params' floating leaves (minus `in_loop`).
    axis_name: the data-parallel axis (or a tuple of axes; an HSDP plan: its mesh's axes).
    has_aux: `loss_fn` returns `(loss, aux)`; `grad_fn` returns `((loss, aux), grads)`.
    has_state: `loss_fn` takes and returns a model state after the params.
    in_loop: path prefixes of params reduced inside a scanned body by `loop_hook`.
    mesh: run on global arrays inside a plain `jax.jit` over this mesh; None: inside your own
      `jax.shard_map` or `jax.pmap`.
    reduction: "mean" (`loss_fn` averages over its examples) or "sum".
    enforce_order: True: the token ties the collectives in plan order; False: XLA combiner keys.

  Returns:
    `grad_fn`; with `mesh`, a `MeshGradFn` on global arrays (`defer_state()`, `deferred_grads`).

  Raises:
    TypeError, ValueError: bad arguments; what an FSDP plan's step does not carry out (axes other than
      the plan's, `in_loop`, HSDP shard axes spanning nodes); with `mesh`, inputs placed otherwise than the
      plan says (the leaf is named).
    UnboundAxisError, ScheduleMismatchError: at trace time (another plan's state: `convert_state`).

  Example:
    >>> grad_fn = prophet_jax.hooked(loss_fn, schedule, axis_name="dp", mesh=mesh)
    >>> loss, grads = grad_fn(params, batch)      # inside your jax.jit
  """
  check_values("hooked", loss_fn=loss_fn, schedule=schedule, axis_name=axis_name)
  _loss_reduction.check(reduction, "hooked")
  for name, flag in (("has_aux", has_aux), ("has_state", has_state)):
    if not isinstance(flag, bool):
      raise TypeError(f"hooked({name}={flag!r}): expected True or False.")
  if isinstance(in_loop, str):
    in_loop = (in_loop,)
  in_loop = tuple(in_loop)
  plan = hook_plan(schedule)
  if plan.family == "fsdp":
    _check_fsdp(schedule, axis_name, in_loop)
  if in_loop and plan.family == "zero1":
    raise ValueError(f"hooked(in_loop={in_loop!r}) with a sharded schedule ({schedule.policy}): "
                     f"loop_hook all-reduces a scanned layer's gradients inside the loop, but a "
                     f"sharded (ZeRO-1) step updates every parameter from its reduce-scatter shard, "
                     f"and the schedule does not cover those params. Plan the sharded schedule over "
                     f"every param and drop in_loop, or use an all-reduce schedule with in_loop.")
  grad_fn = ordered_by(check_enforce_order("hooked", enforce_order),
                       _grad_fn(loss_fn, schedule, plan, axis_name, has_aux, has_state, in_loop, reduction))
  # global arrays in a plain jax.jit: the same grad_fn mapped over the mesh; ZeRO-1's gradient shards
  # are each device's own
  return _mesh.on_mesh(grad_fn, mesh, HookedOnMesh, schedule=schedule, axis_name=axis_name, has_aux=has_aux,
                       has_state=has_state, init_state=(lambda: defer_init(schedule)) if schedule.defers else None,
                       reduction=reduction, grads_spec=(lambda entry, _: P(entry)) if plan.family == "zero1" else None)


class HookedOnMesh(_mesh.MeshGradFn):
  """`hooked(..., mesh=)`'s grad_fn (`_mesh.MeshGradFn`) and its deferral state's values."""

  def deferred_grads(self, defer_state: Any, params: Any) -> Any:
    """The deferred gradient values in `defer_state` (this grad_fn's, on the mesh), combined over the
    data axis (the mean; the sum with reduction='sum'), as a replicated tree like `params` (zeros when
    nothing is deferred): apply them with `tx` at the end of training."""
    place, where = self.place, f"{self._where}(mesh=...)'s grad_fn.deferred_grads"
    body = lambda s, p: _loss_reduction.combine(deferred_grads(s, p), place.axes, self.reduction)  # noqa: E731
    # jitted: un-jitted, a shard_map runs op by op on every device
    return jax.jit(lambda s, p: place(body, (
        ("state", "defer_state", s, "Pass the state this grad_fn returned (it starts from grad_fn.defer_state())."),
        ("params", "params", p, "")), P(), where=where))(defer_state, params)


def _grad_fn(loss_fn: Callable[..., Any], schedule: Schedule, plan: HookPlan, axis_name: Any, has_aux: bool,
             has_state: bool, in_loop: tuple[str, ...], reduction: str) -> Callable[..., Any]:
  """The one grad_fn builder: the plan's hooks placed on the params before `loss_fn` runs, backward's
  collectives issued from their rules on one token chain; the reduced gradients (all-reduce plans,
  with the deferral state in and out) or this device's gradient shards (`GradShards`, ZeRO-1). An FSDP
  plan's step gathers in forward as well: `_fsdp_step.fsdp_grad`, on the parameters' shards."""
  if plan.family == "fsdp":
    return _fsdp_grad_fn(loss_fn, schedule, axis_name, has_aux, has_state, reduction)
  shards = plan.family == "zero1"

  def grad_fn(params, *args, **kwargs):
    given = _NO_STATE
    if "defer_state" in kwargs:
      given = kwargs.pop("defer_state")
    elif args and (schedule.defers or is_state(args[-1])):
      *args, given = args
    setup = step_setup(params, schedule, axis_name, "hooked", defer_state=None if given is _NO_STATE else given,
                       grads=False, skip_prefixes=in_loop)
    n, flat, treedef, lmap, vma = setup.n, setup.flat, setup.treedef, setup.lmap, setup.vma
    defer_state, residual = setup.defer_state, setup.owed
    for p in in_loop:
      if not any(q == p or q.startswith(p.rstrip("/") + "/") for q in lmap.paths):
        raise ValueError(f"hooked(in_loop={in_loop!r}): no leaf of the params has a path starting "
                         f"with {p!r}; the paths look like {lmap.paths[:3]}.")
    divisor = _loss_reduction.divisor(reduction, n)
    hooks = []
    for rows, col in plan.backward:
      leaves = [flat[lmap.row_leaf[r]] for r in rows]
      cast = [vma and not is_varying(x, axis_name) for x in leaves]
      hooks.append((rows, col.extra, _make_hook(col, cast, [(np.shape(x), x.dtype) for x in leaves], axis_name,
                                                n, divisor)))
    varying = (lambda x: to_varying(x, axis_name)) if vma and shards else (lambda x: x)
    if shards:   # each chunk's slot: its shard comes back as the slot's cotangent
      extras = tuple(varying(jnp.zeros((shard_size(c.size, n),), c.dtype)) for c in schedule.chunks)
    else:        # each deferral group's state: the new one comes back as its cotangent
      extras = tuple(_encode(g) for g in group_states(defer_state)) if schedule.defers else ()

    def inner(flat_params, token, extras):
      flat_params = list(flat_params)
      for rows, ex, hook in reversed(hooks):  # backward runs them in reverse: issue order
        ids = [lmap.row_leaf[r] for r in rows]
        out, token = hook([flat_params[i] for i in ids], token, tuple(extras[e] for e in ex))
        for i, x in zip(ids, out):
          flat_params[i] = x
      out = loss_fn(jax.tree_util.tree_unflatten(treedef, flat_params), *args, **kwargs)
      loss = _check_loss_output(out, has_aux, has_state)
      if residual is None:
        return out
      # d/dp sum(r * p) = r: the carried residual joins each leaf's cotangent before its hook reduces
      # it; the value is unchanged (the term minus itself), and the user's output rides as aux
      term = sum(jnp.sum(r.astype(jnp.float32) * x.astype(jnp.float32))
                 for r, x in zip(residual, flat_params) if r is not None)
      return loss + (term - jax.lax.stop_gradient(term)).astype(loss.dtype), out

    calls: list[str] = []
    with _loop_axis(axis_name, divisor, vma, calls):
      value, (grads, tok, new) = jax.value_and_grad(
          inner, argnums=(0, 1, 2), has_aux=has_aux or has_state or residual is not None,
          allow_int=True)(flat, varying(jnp.zeros((), jnp.float32)), extras)
    if residual is not None:
      value = value[1]   # what loss_fn returned: the carry term is not part of the value
    if in_loop and not calls:
      raise ValueError(f"hooked(in_loop={in_loop!r}): loss_fn never called prophet_jax's loop_hook, so "
                       f"those params would not be all-reduced. Apply loop_hook to the layer params "
                       f"inside the scanned body (see models/scan.py), or drop in_loop and plan a "
                       f"schedule that covers them.")
    if shards:
      out = GradShards(shards=tuple(new), token=tok.reshape(1), tag=shard_tag(schedule, n, ""))
    else:
      out = jax.tree_util.tree_unflatten(treedef, grads)
    if schedule.defers:
      return value, out, with_groups(defer_state, [_decode(x) for x in new])
    if given is not _NO_STATE:   # a state was passed (a re-plan's): state in, state out
      return value, out, None
    return value, out

  return grad_fn


def _fsdp_grad_fn(loss_fn: Callable[..., Any], schedule: Schedule, axis_name: Any, has_aux: bool, has_state: bool,
                  reduction: str) -> Callable[..., Any]:
  """`grad_fn(param_shards, [replicated inputs, ...,] batch) -> (value, grad_shards)` of an FSDP plan."""
  def grad_fn(params, *args, **kwargs):
    if kwargs or not args:
      raise TypeError(f"hooked: an FSDP plan's grad_fn takes (params, [replicated inputs such as a model state, "
                      f"...,] batch) positionally, got {len(args) + 1} positional and {sorted(kwargs)} keyword "
                      f"arguments.")
    *reps, batch = args
    value, grads = fsdp_grad((lambda p, b: loss_fn(p, *reps, b)) if reps else loss_fn, schedule,
                             axis_name=axis_name, reduction=reduction)(params, batch)
    _check_loss_output(value, has_aux, has_state)
    return value, grads

  return grad_fn


def _check_fsdp(schedule: Schedule, axis_name: Any, in_loop: tuple[str, ...]) -> None:
  """ValueError for what an FSDP plan's step does not carry out, naming the fix."""
  split_axes(schedule, axis_name, "hooked")
  if in_loop:
    raise ValueError(f"hooked(in_loop={in_loop!r}) with an FSDP plan: its step gathers and reduce-scatters a "
                     f"scanned stack's layers inside the loop itself (plan the stack per layer); drop in_loop.")
