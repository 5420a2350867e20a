"""A plan's buckets for users who keep their step: the model's layers tagged with XLA combiner keys.

A plain `jax.jit` step on global arrays (params replicated, the batch split over the data axis) gets its
gradient all-reduces from the SPMD partitioner: one per weight gradient, which XLA's all-reduce combiner
then joins up to one threshold per executable. Traced under
`jax.experimental.xla_metadata.set_xla_metadata(combiner_key=...)`, a layer's forward ops carry the key,
their transposes (the backward ops whose partial sums the partitioner all-reduces) carry it too, and
XLA:GPU's combiner joins exactly the all-reduces of one key (docs/facts.md, "Buckets in XLA's own terms").
So a plan becomes XLA's buckets with no change to the step: only its trace runs inside

    with prophet_jax.tag_layers(schedule):                 # flax linen (nn.intercept_methods)
      loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    with prophet_jax.tag_layers(schedule, model=model):    # flax nnx (the model's own modules)
      loss, grads = nnx.value_and_grad(loss_fn)(model, batch)

Where the partitioner cannot follow a plan (`TaggedPlan.notes` says which, per plan):
- **a bucket that cuts a leaf**: a leaf's gradient is one all-reduce, so it cannot be split;
- **a layer whose leaves are in different units** (a kernel in one chunk, its bias in the next): a
  layer's ops carry one key, so its leaves cannot be parted either. The nearest tagging (`tag_plan`)
  gives each layer whole to the unit that holds most of its elements: every boundary of the plan that
  falls between layers is kept, one inside a layer moves to the layer's edge (the fewest elements
  moved), and a unit left with no layer of its own disappears;
- **order**: the partitioner's all-reduces carry no tie; their order is XLA's (the audit reports it);
- **deferral and sharding**: a deferral group's slots are chosen at run time, a ZeRO-1 plan's collectives
  are reduce-scatters and an FSDP plan's gathers and reduce-scatters go in groups of their own: none is the
  partitioner's all-reduce (ValueError: use the rewrite, or `xla_options` for an FSDP plan's thresholds).
XLA:CPU ignores the key: on the CPU a tagged step is the plain step (its numbers are).
"""

from __future__ import annotations

import collections
import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any


from ._keys import combiner_key
from .._compiled._audit import audit_keyed
from .._compiled._keyed_audit import KeyedUnit
from .._values._schedule import Schedule

TAG_PREFIX = "prophet/bucket"
_ATTR = "_prophet_combiner_key"


def layer_of_path(path: str) -> str:
  """The layer (module path) a parameter path belongs to: the path without its leaf name, a leading
  `params` collection and a trailing nnx `value`: 'params/Block_0/Dense_1/kernel' -> 'Block_0/Dense_1',
  'l1/kernel/value' -> 'l1'; '' for a parameter of the top module."""
  parts = [p for p in path.split("/") if p]
  if parts and parts[-1] == "value":
    parts = parts[:-1]
  if len(parts) > 1 and parts[0] == "params":
    parts = parts[1:]
  return "/".join(parts[:-1])


@dataclass(frozen=True, slots=True)
class TaggedBucket:
  """One combiner key of a tagged plan.

  Attributes:
    key: the combiner key ('prophet/bucket<i>').
    layers: the module paths whose ops carry it.
    units: the plan's units (issue order) holding any of its layers' elements: one when the plan's
      unit is followed exactly.
    elements: the gradient elements its all-reduce reduces (every leaf of its layers).
  """

  key: str
  layers: tuple[str, ...]
  units: tuple[int, ...]
  elements: int


@dataclass(frozen=True, slots=True)
class TaggedPlan:
  """The nearest tagging of a plan (`tag_plan`): its buckets, the layer -> key map and what differs.

  Attributes:
    schedule: the plan.
    buckets: the keys, in the order of the plan's first unit of each.
    keys: layer path -> combiner key.
    exact: every bucket is exactly one of the plan's units.
    notes: where the tagging cannot follow the plan, one line each (always the order's).
  """

  schedule: Schedule
  buckets: tuple[TaggedBucket, ...]
  keys: Mapping[str, str]
  exact: bool
  notes: tuple[str, ...]

  def units(self) -> tuple[KeyedUnit, ...]:
    """What a compiled tagged step should hold: one all-reduce per bucket (for `prophet_jax.audit(...,
    tagged=)`), the bucket's layers its provenance."""
    return tuple(KeyedUnit(i, b.elements, frozenset(w for layer in b.layers for w in layer.split("/")))
                 for i, b in enumerate(self.buckets))

  def audit(self, compiled: Any) -> Any:
    """The AuditReport of a compiled tagged step: one all-reduce per bucket, matched by element count
    and operand provenance (`_compiled._keyed_audit`; the partitioner's combined all-reduces keep no
    name), its planned size, the order XLA chose and the compute inside each window."""
    return audit_keyed(compiled, self.schedule, units=self.units())


def tag_plan(schedule: Schedule) -> TaggedPlan:
  """The nearest tagging of `schedule` by layers: each layer whole with the unit holding most of its
  elements (module docstring), one combiner key per unit left holding a layer.

  Raises:
    ValueError: a ZeRO-1, FSDP or deferring plan (the partitioner's all-reduce cannot carry it).
  """
  if not isinstance(schedule, Schedule):
    raise TypeError(f"tag_plan(schedule={schedule!r:.60}): expected a prophet_jax.Schedule.")
  if schedule.family != "allreduce" or schedule.defers:
    what = {"zero1": "reduce-scatters and all-gathers (ZeRO-1)",
            "fsdp": "parameter all-gathers and gradient reduce-scatters in groups of its own (FSDP)"}.get(
                schedule.family, "deferral groups chosen at run time")
    fix = ("Run it with prophet_jax.hooked(..., mesh=) (an FSDP plan: hooked only), or, for a plain FSDP step, "
           "take its all-gather and reduce-scatter thresholds from prophet_jax.xla_options(schedule, network)"
           if schedule.family == "fsdp" else "Run it with the rewrite (prophet_jax.hooked(..., mesh=) or scheduled)")
    raise ValueError(f"tag_layers: a {schedule.policy!r} plan (family {schedule.family!r}) issues {what}, "
                     f"which combiner keys on the partitioner's gradient all-reduces cannot carry. {fix}, "
                     f"or tag a lossless all-reduce plan.")
  paths = [r[0] for r in schedule.rows]
  sizes = [math.prod(int(d) for d in r[1]) for r in schedule.rows]
  layer = [layer_of_path(p) for p in paths]
  chunks = schedule.chunks
  # each layer goes whole to the unit holding most of its elements (the earliest of equals)
  held: dict[str, collections.Counter] = {}   # layer -> elements per unit
  units_of_row: dict[int, list[int]] = {}
  for k, c in enumerate(chunks):
    for r, a, b in c.slices:
      held.setdefault(layer[r], collections.Counter())[k] += b - a
      units_of_row.setdefault(r, []).append(k)
  owner = {name: max(sorted(per), key=lambda k: (per[k], -k)) for name, per in held.items()}
  buckets, keys = [], {}
  for k in sorted(set(owner.values())):
    layers = tuple(name for name in dict.fromkeys(layer) if owner.get(name) == k)
    key = f"{TAG_PREFIX}{len(buckets)}"
    keys.update({name: key for name in layers})
    joined = tuple(sorted({j for name in layers for j in held[name]}))
    buckets.append(TaggedBucket(key=key, layers=layers, units=joined,
                                elements=sum(sizes[r] for r in range(len(paths)) if owner.get(layer[r]) == k)))
  notes = [f"leaf {paths[r]!r} is cut by units {ks}: a leaf's gradient is one all-reduce; it goes whole "
           f"with unit {owner[layer[r]]}" for r, ks in units_of_row.items() if len(set(ks)) > 1]
  notes += [f"layer {name!r} has leaves in units {sorted(per)}: a layer's ops carry one key; it goes whole "
            f"with unit {owner[name]} (most of its elements)" for name, per in held.items()
            if len(per) > 1 and not any(len(set(units_of_row[r])) > 1 for r in range(len(paths))
                                        if layer[r] == name)]
  empty = sorted(set(range(len(chunks))) - set(owner.values()))
  if empty:
    notes.append(f"units {empty[:10]} hold no layer of their own after that: no bucket")
  if "" in keys:
    notes.append("parameters of the top module (no layer of their own) share one key with every op of the "
                 "model's own __call__")
  notes.append("order: XLA's (the partitioner's all-reduces carry no tie)")
  exact = len(buckets) == len(chunks) and not notes[:-1]
  return TaggedPlan(schedule=schedule, buckets=tuple(buckets), keys=keys, exact=exact, notes=tuple(notes))


@contextlib.contextmanager
def tag_layers(plan: Schedule | TaggedPlan, *, model: Any = None) -> Iterator[TaggedPlan]:
  """Traces the model's layers with the plan's combiner keys (module docstring): the partitioner's
  gradient all-reduces of a plain `jax.jit` step then come out as `tag_plan(plan)`'s buckets on
  XLA:GPU. Wrap the *trace* of the step's gradient (inside the jitted function, or around the first
  call that traces it).

  Args:
    plan: a Schedule (lossless, all-reduce) or its `tag_plan`.
    model: a flax nnx Module (its submodules are tagged by their attribute paths); None for flax linen
      (every module call is intercepted, `flax.linen.intercept_methods`, and keyed by its path).

  Yields:
    The TaggedPlan (its `notes` say where it differs from the plan).

  Example:
    >>> @jax.jit
    ... def step(params, batch):
    ...   with prophet_jax.tag_layers(schedule):
    ...     loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    ...   return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss
  """
  tagged = plan if isinstance(plan, TaggedPlan) else tag_plan(plan)
  if model is None:
    # imported here: flax is needed only for the linen interceptor
    import flax.linen as nn

    def interceptor(next_fun, args, kwargs, context):
      # every method of a tagged module: a tied embedding's `attend` reads its params too
      with combiner_key(tagged.keys.get("/".join(str(p) for p in context.module.path))):
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(interceptor):
      yield tagged
    return
  with _nnx_keys(model, tagged):
    yield tagged


@contextlib.contextmanager
def _nnx_keys(model: Any, tagged: TaggedPlan) -> Iterator[None]:
  """Marks each tagged submodule of an nnx `model` with its key (a static attribute, which nnx
  transforms carry into their traces) and keys the `__call__` of their classes while inside."""
  # imported here: flax nnx is needed only for an nnx model
  from flax import nnx

  if not isinstance(model, nnx.Module):
    raise TypeError(f"tag_layers(model={type(model).__name__}): expected a flax nnx Module (or model=None "
                    f"for flax linen, whose module calls are intercepted).")
  modules = nnx.iter_modules(model) if hasattr(nnx, "iter_modules") else model.iter_modules()
  named = [("/".join(str(p) for p in path), mod) for path, mod in modules]
  unknown = set(tagged.keys) - {name for name, _ in named}
  if unknown:
    raise ValueError(f"tag_layers: the plan's layers {sorted(unknown)[:5]} are not submodules of this nnx "
                     f"model; plan from nnx.state(model, nnx.Param) of this model.")
  marked = [(mod, tagged.keys[name]) for name, mod in named if name in tagged.keys]
  for mod, key in marked:
    object.__setattr__(mod, _ATTR, key)
  classes = {type(mod): type(mod).__dict__.get("__call__") for mod, _ in marked}
  for cls, own in classes.items():
    call = cls.__call__

    def keyed(self, *args, __call=call, **kwargs):
      with combiner_key(getattr(self, _ATTR, None)):
        return __call(self, *args, **kwargs)

    cls.__call__ = keyed
  try:
    yield
  finally:
    for cls, own in classes.items():
      if own is None:
        del cls.__call__
      else:
        cls.__call__ = own
    for mod, _ in marked:
      if _ATTR in vars(mod):
        object.__delattr__(mod, _ATTR)
