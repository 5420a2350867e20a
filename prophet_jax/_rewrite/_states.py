"""The library's per-device states, declared once: what a step carries from one call to the next.

Each kind declares, beside its class (`declare`), its per-device fields, how a per-device leaf is named,
where `flax.nnx` keeps it, and its conversion step; `state_specs`, `param_specs`, `per_device_leaves`
and the conversion read the declarations. One tag (`StateTag`) records a state's schedule and layout.
docs/design.md, "The rewrite's layers". Saved states keep their field names and key paths.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import PartitionSpec

from . import _tag_text
from .._values._schedule import Schedule
from .._values._tree import IdentityMemo, path_str, row_slots

# --------------------------------------------------------------------------------------------------
# the one tag


@IdentityMemo(64)
def schedule_key(schedule: Schedule) -> str:
  """A short hash of everything a state's layout depends on: the tree fingerprint, every bucket's
  chunks (their slices), its deferral and release, and the gathers of a sharded schedule."""
  h = hashlib.sha256(schedule.tree_fingerprint.encode())
  for b in schedule.buckets:
    h.update(repr((tuple(c.slices for c in b.chunks), b.defer) + ((b.release,) if b.release != 1 else ()))
             .encode())
  h.update(repr(schedule.gathers).encode())
  return h.hexdigest()[:16]


class ShardLayout(NamedTuple):
  """A shard state's layout: the axis size `n` its shards were cut for, `shard_size` of every chunk,
  and the mode ('elementwise' or 'global-norm' for an optimizer state, '' for gradient shards)."""

  n: int
  sizes: tuple[int, ...]
  mode: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class _ScheduleRef:
  """The schedule a tag was made for, in the tag's pytree data; compared by the schedule's key alone."""

  key: str
  schedule: Schedule | None = dataclasses.field(compare=False)

  def __repr__(self) -> str:
    return f"<schedule {self.key}>"


@jax.tree_util.register_pytree_node_class
class StateTag:
  """A leafless pytree node whose structure says which schedule a state belongs to, and its layout.

  Attributes:
    key: `schedule_key` of the schedule.
    fingerprint: the schedule's `tree_fingerprint` (for messages).
    layout: a DeferState's (m, rows, c, dtype) per deferral group, in issue order; a ShardedState's or
      GradShards' `ShardLayout`.
    schedule: the Schedule itself (what `convert` and a re-plan's carry need), or None.
  """

  __slots__ = ("key", "fingerprint", "layout", "_ref")

  def __init__(self, key: str, fingerprint: str, layout: Any, schedule: Schedule | _ScheduleRef | None = None):
    self.key, self.fingerprint = key, fingerprint
    self.layout = layout if isinstance(layout, ShardLayout) else tuple(layout)
    self._ref = schedule if isinstance(schedule, _ScheduleRef) else _ScheduleRef(key, schedule)

  @classmethod
  def of(cls, schedule: Schedule, layout: Any) -> StateTag:
    return cls(schedule_key(schedule), schedule.tree_fingerprint, layout, schedule)

  @property
  def schedule(self) -> Schedule | None:
    return self._ref.schedule

  # a shard state's layout, by name
  n = property(lambda self: self.layout.n)
  sizes = property(lambda self: self.layout.sizes)
  mode = property(lambda self: self.layout.mode)

  def tree_flatten(self):  # the metadata's repr says what the state is (jax prints it on a mismatch)
    return (), _tag_text.StateAux((self.key, self.fingerprint, self.layout, self._ref))

  @classmethod
  def tree_unflatten(cls, aux, _):
    return cls(*aux)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, StateTag) and (self.key, self.layout) == (other.key, other.layout)

  def __hash__(self) -> int:
    return hash((self.key, self.layout))

  def __repr__(self) -> str:
    return f"StateTag({_tag_text.describe(self.key, self.fingerprint, self.layout)[0]})"


# --------------------------------------------------------------------------------------------------
# the kinds: each state type declares itself once


class Kind(NamedTuple):
  """What a state type declares once, beside its class (`declare`); every helper reads it.

  Attributes:
    per_device: the fields each device holds its own values of (`P(axis)` under shard_map, a leading
      device axis on a mesh); the other fields are replicated or nested states.
    label: how a per-device leaf is named in messages ('{}' takes its index or path).
    nnx: where a container that re-labels NamedTuples as dicts (`flax.nnx`) keeps a per-device leaf:
      entry names that must appear in order on its path.
    convert: the name of its conversion step between schedules (`_convert.Conversion`'s method).
    container: it holds other states (a step's whole state), not only arrays.
  """

  per_device: tuple[str, ...] = ()
  label: str = ""
  nnx: tuple[tuple[str, ...], ...] = ()
  convert: str = ""
  container: bool = False


KINDS: dict[type, Kind] = {}


def declare(**kind: Any):
  """Class decorator: registers a state type's `Kind`."""
  def put(cls: type) -> type:
    KINDS[cls] = Kind(**kind)
    return cls
  return put


def kind_of(x: Any) -> Kind | None:
  """The declared kind of `x`'s type, or None for anything else."""
  return KINDS.get(type(x))


# --------------------------------------------------------------------------------------------------
# the states


@declare(convert="scheduled", container=True)
class ScheduledState(NamedTuple):
  """State of `scheduled(tx, ...)`.

  Attributes:
    inner: the wrapped transformation's state, unchanged (a `ShardedState` under a sharded schedule).
    defer_state: the schedule's `DeferState` (`prophet_jax.defer_state`) when it defers (`dlcp` with
      `max_defer > 0`), else None. Its residuals are each device's own: under `shard_map`, pass the
      whole optimizer state with `prophet_jax.state_specs(opt_state, axis_name)`.
    accum: with `every_k > 1`, the gradient accumulator (`AccumState`: the micro-step count and each
      device's sums, which `state_specs` also gives `P(axis_name)`), else None.
  """

  inner: Any
  defer_state: Any = None
  accum: Any = None


@declare(per_device=("residual",), label="the deferral state's residual of group {}",
         nnx=(("defer_state", "residual"),), convert="defer")
class DeferState(NamedTuple):
  """The deferral state of a schedule's deferral groups (one entry per group, in issue order).

  Attributes:
    norms: f32[m] per group: the L2 norm of each chunk's reduced values when it was last sent
      (replicated).
    deferred: bool[m] per group: the chunks deferred in the previous step (replicated).
    index: int32[k] per group: their chunk numbers, in rank order (replicated); under damped
      feedback (`Bucket.release` < 1) int32[m], every chunk's number in order.
    residual: dtype[1, k, c] per group: this device's values of those chunks, added to the same
      elements at the next step (per device); dtype[1, m, c] under damped feedback: each chunk's
      values not yet sent.
    tag: no arrays; its pytree structure names the schedule (`StateTag`).
  """

  norms: tuple[jax.Array, ...]
  deferred: tuple[jax.Array, ...]
  index: tuple[jax.Array, ...]
  residual: tuple[jax.Array, ...]
  tag: StateTag

  @property
  def lead(self) -> tuple[int, ...]:
    """The device axes in front of each device's values: (1,) per device (inside a mapping), (n,) on
    a mesh (global), (n, 1) under pmap."""
    return tuple(np.shape(self.residual[0])[:-2])


@declare(per_device=("per_device",), label="the sharded optimizer state's leaf {}", nnx=(("per_device",),),
         convert="sharded")
class ShardedState(NamedTuple):
  """The optimizer state of `scheduled(tx, sharded_schedule)` (ZeRO-1): `tx`'s state for this
  device's shards only.

  Attributes:
    per_device: `tx.init` of this device's shards (a tuple of 1-D arrays, one per chunk, and a float32
      scalar in 'global-norm' mode), every leaf with a leading axis of 1: each device's own
      (`P(axis_name)` under shard_map, `state_specs` says so; under pmap, per device as any state).
    tag: no arrays; its structure records the schedule, the axis size and the mode (`StateTag` with a
      `ShardLayout`).
  """

  per_device: Any
  tag: StateTag


class _GradShardsFields(NamedTuple):
  shards: tuple[jax.Array, ...]
  token: jax.Array
  tag: StateTag


@declare(per_device=("shards", "token"), label="the gradient shards' leaf {}")
class GradShards(_GradShardsFields, metaclass=_tag_text.HintedClass):
  """This device's reduced gradient shards, as `hooked(loss_fn, sharded_schedule)` returns them.

  The reduce-scatters ran inside backward; `scheduled(tx, schedule)`'s `update` takes this value in
  place of the gradients (and the params, which it needs to lay out the update), skips its own
  reduce-scatters, runs `tx` on the shards and all-gathers the update: the DeAR pipeline.

  Attributes:
    shards: the mean gradient of this device's shard of every chunk (`shard_size` elements each), in
      chunk order.
    token: shape (1,): an exact zero tied to the last reduce-scatter's result (the next all-gather of
      the same tie chain is tied to it).
    tag: no arrays; the schedule and the axis size (`StateTag`, mode '').
  """

  __slots__ = ()
  # jax names this class when a plain optax tx is given the shards (its tree_map fails before any
  # library code runs): the class's repr says what pairs with them
  __hint__ = ("the gradient shards of hooked(loss_fn, sharded_schedule): only the update of "
              "prophet_jax.scheduled(tx, schedule, axis_name=...) takes them, not a plain optax tx; wrap tx "
              "in prophet_jax.scheduled (docs/pairing.md)")


@declare(per_device=("grads",), label="the gradient accumulator's sum {}", nnx=(("accum", "grads"),),
         convert="accum")
class AccumState(NamedTuple):
  """The gradient accumulator of `scheduled(..., every_k=k)`.

  Attributes:
    count: int32[]: micro-steps accumulated since the last all-reduce (replicated; 0 after the k-th).
    grads: per schedule row (its order), `(1, *row shape)`: this device's sum of the micro-step
      gradients since the last all-reduce (float32 for rows narrower than 32 bits).
  """

  count: jax.Array
  grads: tuple[jax.Array, ...]


@declare(per_device=("owed",), label="the converted state's owed values {}",
         nnx=(("defer_state", "owed"), ("defer", "owed")), convert="owed")
class OwedState(NamedTuple):
  """Deferred gradient values a re-plan owes the new schedule's first step (`convert_state`).

  Stands where the new schedule's step takes its deferral state (`ScheduledState.defer_state`,
  `PipelinedState.defer`, the `defer_state` of `hooked`'s grad_fn and `allreduce`). The first step
  adds `owed` to this device's gradients before its all-reduces and returns the schedule's steady
  state (its initial DeferState, or None): nothing deferred is lost.

  Attributes:
    owed: per schedule row (its order), `(1, *row shape)` in the row's dtype: this device's values
      (each device's own, `P(axis)` under shard_map, as `state_specs` says).
    tag: no arrays; the schedule it is owed to (`StateTag` with layout ("owed", rows)).
  """

  owed: tuple[jax.Array, ...]
  tag: StateTag

  @property
  def lead(self) -> tuple[int, ...]:
    """The device axes in front of each device's values, as `DeferState.lead`."""
    rows = self.tag.schedule.rows
    shape = np.shape(self.owed[0]) if self.owed else (1,)
    return tuple(shape[:len(shape) - (len(rows[0][1]) if rows else 0)])


def is_state(x: Any) -> bool:
  """Whether `x` is one of the library's per-device states (a kind of arrays, not a container)."""
  kind = kind_of(x)
  return kind is not None and not kind.container


def _key_name(k: Any) -> Any:
  """The name in a pytree path entry (a dict key, an attribute or field name), else None."""
  for attr in ("key", "name"):
    v = getattr(k, attr, None)
    if isinstance(v, str):
      return v
  return None


def per_device_path(names: Sequence[Any]) -> bool:
  """Whether a leaf at a path of entry names is each device's own, where a container re-labelled the
  library's NamedTuples (`flax.nnx` keeps them as nested dicts): on a path some kind declares (`nnx`)."""
  def has(pattern: tuple[str, ...]) -> bool:   # the pattern's names in order along the path
    rest = iter(names)
    return all(p in rest for p in pattern)

  return any(has(p) for k in KINDS.values() for p in k.nnx)


def _fields(x: Any) -> list[tuple[str, Any, bool]]:
  """(field name, value, per device?) of a declared state."""
  per = kind_of(x).per_device
  return [(f, getattr(x, f), f in per) for f in x._fields]


def expect(x: Any, cls: type, message: str) -> None:
  """TypeError(`message`) unless `x` is a state of kind `cls` (the one type check of a declared kind)."""
  if not isinstance(x, cls):
    raise TypeError(message)


def is_kind(x: Any) -> bool:
  """Whether `x` is one of the library's declared states (per-device states and their containers)."""
  return kind_of(x) is not None


def holds_state(tree: Any) -> bool:
  """Whether `tree` is or holds one of the library's declared states."""
  return any(is_kind(y) for y in jax.tree_util.tree_leaves(tree, is_leaf=is_kind))


def prefix_specs(cls: type, axis_name: Any) -> Any:
  """A prefix PartitionSpec valid for every state of kind `cls` (one with replicated fields: DeferState,
  AccumState): the NamedTuple of its fields' specs."""
  per = KINDS[cls].per_device
  return cls(**{f: PartitionSpec(axis_name) if f in per else PartitionSpec() for f in cls._fields})


def param_specs(params: Any, schedule: Any, axis_name: Any) -> Any:
  """The parameters' PartitionSpecs, the rule for every family: each leaf as the plan places it
  (`Schedule.placement`: split over `axis_name` on its dimension, or replicated), leaves no row covers
  replicated. Today's all-reduce and ZeRO-1 plans replicate every parameter; an HSDP plan run over its
  mesh's axes splits over its shard axes alone."""
  P = PartitionSpec
  if all(d is None for d in schedule.placement):
    return jax.tree_util.tree_map(lambda _: P(), params)
  shard = schedule.fsdp.shard_axes if schedule.fsdp is not None else ()
  if isinstance(axis_name, tuple) and set(axis_name) > set(shard):
    axis_name = shard[0] if len(shard) == 1 else tuple(shard)
  kp, treedef = jax.tree_util.tree_flatten_with_path(params)
  dims: dict[int, int] = {}   # leaf -> its split dimension (a scanned stack's one past its layers' axis)
  for slot, d in zip(row_slots(schedule.rows, [path_str(p) for p, _ in kp], [np.ndim(x) for _, x in kp]),
                     schedule.placement):
    if slot is not None and d is not None:
      dims[slot[0]] = d + (slot[1] is not None)
  return jax.tree_util.tree_unflatten(treedef, [
      P(*[None] * dims[i], axis_name, *[None] * (np.ndim(x) - dims[i] - 1)) if i in dims else P()
      for i, (_, x) in enumerate(kp)])


def state_specs(state: Any, axis_name: Any, like: tuple[Any, Any] | None = None) -> Any:
  """PartitionSpecs for `jax.shard_map` of any state holding the library's per-device parts (an optax
  state, a TrainState, a PipelinedState, a `flax.nnx` state, ...): `P(axis_name)` for every leaf of a
  `ShardedState` (a sharded schedule's optimizer state: each device's shard, on a leading axis of 1)
  and of `GradShards`, for each DeferState's residuals and for each gradient accumulator's sums
  (`scheduled(..., every_k=k)`'s `AccumState`); `P()` for every other leaf (replicated).

  A ShardedState, DeferState or AccumState is found by its type, or, where a container re-labelled its
  fields (`flax.nnx` stores an optimizer state as nested dicts of Variables), by its path: a leaf under a
  `per_device` entry, under a `residual` entry under a `defer_state` entry, or under a `grads` entry
  under an `accum` entry.

  Args:
    state: the state (arrays or ShapeDtypeStructs; for a sharded schedule, made inside the mapping:
      its shard sizes depend on the axis size).
    axis_name: the data-parallel mesh axis.

    like: (params, their specs): every part of `state` shaped as the params takes their specs.

  Returns:
    A tree of PartitionSpecs with the structure of `state`.
  """
  def one(path, x):
    if is_kind(x):
      return type(x)(*(jax.tree_util.tree_map(lambda _: PartitionSpec(axis_name), v) if per else
                       state_specs(v, axis_name) for _, v, per in _fields(x)))
    return PartitionSpec(axis_name) if per_device_path([_key_name(k) for k in path]) else PartitionSpec()

  specs = jax.tree_util.tree_map_with_path(one, state, is_leaf=is_kind)
  if like is None:
    return specs
  params, pspecs = like   # a part shaped as the params (an optimizer's moments) placed as they are
  treedef = jax.tree_util.tree_structure(params)
  match = lambda x: treedef.num_nodes > 1 and jax.tree_util.tree_structure(x) == treedef  # noqa: E731
  return jax.tree_util.tree_map(lambda x, s: pspecs if match(x) else s, state, specs, is_leaf=match)


def per_device_leaves(state: Any) -> list[tuple[str, Any]]:
  """(a name for messages, the leaf) for every leaf of `state` that `state_specs` gives the axis: what
  a placement check reads (each device's part, on the leading axis of a global array)."""
  out: list[tuple[str, Any]] = []
  for path, x in jax.tree_util.tree_flatten_with_path(state, is_leaf=is_kind)[0]:
    if is_kind(x):
      label = kind_of(x).label
      for _, v, per in _fields(x):
        if not per:
          out += per_device_leaves(v)
          continue
        flat = jax.tree_util.tree_flatten_with_path(v)[0]
        out += [(label.format(i if len(p) == 1 else jax.tree_util.keystr(p)), y) for i, (p, y) in enumerate(flat)]
    elif per_device_path([_key_name(k) for k in path]):
      out.append((f"the state's leaf {jax.tree_util.keystr(path)}", x))
  return out
