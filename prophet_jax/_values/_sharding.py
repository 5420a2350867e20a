"""FSDP's plan (`FsdpPlan`) and its check against a Schedule (pure numpy; docs/fsdp.md, "The plan")."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._errors import ScheduleError
from ._placement import Placed, check_mesh, placement_fingerprint
from ._types import is_bool, is_int

@dataclass(frozen=True, slots=True, kw_only=True)
class FsdpPlan(Placed):
  """The FSDP part of a Schedule: which chunks are FSDP buckets, their gathers, prefetch and keeps.

  Attributes:
    units: the chunk index of every FSDP bucket, in forward use order; other chunks are replicated
      leaves' all-reduces.
    keep: per unit (or per all-gather group): keep the forward's gathered parameters until backward
      (True) or free them and gather again in backward (False).
    prefetch: forward prefetch depth d >= 1 (unit u gathered when unit u - d's forward starts).
    backward_prefetch: the same depth for backward's re-gathers, in backward order.
    shard_dims: per schedule row, its sharded dimension, or None (replicated).
    mesh, shard_axes: the mesh shape and the axes sharded rows are split over (others: HSDP replicas).
    memory_budget_bytes: the per-device budget it was planned under, or None.
    gathers: () (each unit gathered whole) or the all-gather groups as row indices, forward order.
    in_flight: the collectives XLA:GPU keeps in flight that the plan was made for (1: XLA:GPU's default
      overlap limit), or None: no limit (plans made before the option).
    gather_dtypes: () (every leaf gathered in its dtype) or per schedule row the dtype it is all-gathered
      in (None: its own); a unit is reduce-scattered in its rows' dtype.
    micro_batches: the micro-batches k one step runs (docs/fsdp.md, "Accumulation").
    hold_params: () or per all-gather group: gather once and hold across the k micro-batches (True), or
      gather each micro-batch as `keep` says (False).
    hold_grads: () or per unit: hold its whole gradient and reduce-scatter once (True), or reduce-scatter
      each micro-batch into a shard accumulator (False).
  """

  units: tuple[int, ...]
  keep: tuple[bool, ...]
  prefetch: int = 1
  backward_prefetch: int = 1
  shard_dims: tuple[int | None, ...]
  mesh: tuple[tuple[str, int], ...]
  shard_axes: tuple[str, ...]
  memory_budget_bytes: int | None = None
  gathers: tuple[tuple[int, ...], ...] = ()
  in_flight: int | None = None
  gather_dtypes: tuple[str | None, ...] = ()
  micro_batches: int = 1
  hold_params: tuple[bool, ...] = ()
  hold_grads: tuple[bool, ...] = ()

  def __post_init__(self):
    g = self.gathers
    if isinstance(g, (str, bytes, Mapping)) or not isinstance(g, (tuple, list)) or not all(
        isinstance(x, (tuple, list)) and x and all(map(is_int, x)) for x in g):
      raise ScheduleError(f"FsdpPlan has gathers={g!r:.80}; expected lists of row indices (ints), one per "
                          f"all-gather group, or [] (each unit gathered whole).")
    object.__setattr__(self, "gathers", tuple(tuple(int(r) for r in x) for x in g))
    for name in ("units", "keep", "shard_dims", "shard_axes"):
      v = getattr(self, name)
      if isinstance(v, (str, bytes, Mapping)) or not isinstance(v, (tuple, list)):
        raise ScheduleError(f"FsdpPlan has {name}={v!r}; expected a list.")
      object.__setattr__(self, name, tuple(v))
    if not all(map(is_int, self.units)):
      raise ScheduleError(f"FsdpPlan has units={self.units!r}; expected chunk indices (ints).")
    object.__setattr__(self, "units", tuple(int(u) for u in self.units))
    if len(set(self.units)) != len(self.units):
      raise ScheduleError(f"FsdpPlan names a chunk twice in units={self.units}; each FSDP bucket is "
                          f"gathered once per forward.")
    n_keep = len(self.gathers) if self.gathers else len(self.units)
    if len(self.keep) != n_keep or not all(map(is_bool, self.keep)):
      raise ScheduleError(f"FsdpPlan has keep={self.keep!r}; expected one True/False per "
                          f"{'all-gather group' if self.gathers else 'unit'} ({n_keep}).")
    object.__setattr__(self, "keep", tuple(bool(k) for k in self.keep))
    for name, n in (("hold_params", n_keep), ("hold_grads", len(self.units))):
      v = getattr(self, name)
      if isinstance(v, (str, bytes, Mapping)) or len(v) not in (0, n) or not all(map(is_bool, v)):
        raise ScheduleError(f"FsdpPlan has {name}={v!r:.80}; expected [] or {n} True/False.")
      object.__setattr__(self, name, tuple(bool(x) for x in v))
    for name in ("prefetch", "backward_prefetch", "in_flight", "micro_batches"):
      v = getattr(self, name)
      if name == "in_flight" and v is None:
        continue
      if not is_int(v) or v < 1:
        raise ScheduleError(f"FsdpPlan has {name}={v!r}; expected an integer >= 1"
                            f"{' or null' if name == 'in_flight' else ''}.")
      object.__setattr__(self, name, int(v))
    if isinstance(self.gather_dtypes, (str, bytes, Mapping)) or not all(
        d is None or isinstance(d, str) for d in self.gather_dtypes):
      raise ScheduleError(f"FsdpPlan has gather_dtypes={self.gather_dtypes!r:.80}; expected dtype names or null.")
    object.__setattr__(self, "gather_dtypes", tuple(self.gather_dtypes))
    if not all(d is None or is_int(d) for d in self.shard_dims):
      raise ScheduleError(f"FsdpPlan has shard_dims={self.shard_dims!r:.80}; expected ints or null.")
    object.__setattr__(self, "shard_dims", tuple(None if d is None else int(d) for d in self.shard_dims))
    try:
      object.__setattr__(self, "mesh", check_mesh("FsdpPlan", self.mesh))
    except ValueError as e:
      raise ScheduleError(str(e)) from None
    bad = [a for a in self.shard_axes if a not in dict(self.mesh)]
    if bad or not self.shard_axes:
      raise ScheduleError(f"FsdpPlan has shard_axes={self.shard_axes!r}; expected mesh axes of "
                          f"{dict(self.mesh)}.")
    b = self.memory_budget_bytes
    if b is not None and (not is_int(b) or b < 0):
      raise ScheduleError(f"FsdpPlan has memory_budget_bytes={b!r}; expected an integer >= 0 or null.")


  def to_dict(self) -> dict[str, Any]:
    return {"units": list(self.units), "keep": list(self.keep), "prefetch": self.prefetch,
            "backward_prefetch": self.backward_prefetch, "shard_dims": list(self.shard_dims),
            "mesh": dict(self.mesh), "shard_axes": list(self.shard_axes),
            "memory_budget_bytes": self.memory_budget_bytes} | (
                {"gathers": [list(x) for x in self.gathers]} if self.gathers else {}) | (
                {"in_flight": self.in_flight} if self.in_flight is not None else {}) | (
                {"gather_dtypes": list(self.gather_dtypes)} if self.gather_dtypes else {}) | (
                {"micro_batches": self.micro_batches, "hold_params": list(self.hold_params),
                 "hold_grads": list(self.hold_grads)} if self.micro_batches > 1 else {})

  @classmethod
  def from_dict(cls, obj: Any) -> FsdpPlan:
    if not isinstance(obj, Mapping):
      raise ScheduleError(f"Schedule.from_json: 'fsdp' must be an object of FsdpPlan fields, got {obj!r:.60}.")
    names = set(cls.__dataclass_fields__)
    unknown = sorted(set(obj) - names)
    if unknown:
      raise ScheduleError(f"Schedule.from_json: 'fsdp' has unknown field(s) {unknown}; expected some of "
                          f"{sorted(names)}.")
    try:
      return cls(**obj)
    except TypeError as e:
      raise ScheduleError(f"Schedule.from_json: 'fsdp': {e}") from None


def fsdp_fingerprint(rows_fingerprint: str, plan: FsdpPlan | None) -> str:
  """A schedule's tree fingerprint, with an FSDP plan's placement folded in."""
  if plan is None:
    return rows_fingerprint
  return placement_fingerprint(rows_fingerprint, plan.shard_dims, plan.mesh, plan.shard_axes)


def check_fsdp(s: Any) -> None:
  """An FSDP plan against its schedule's chunks (one link, no gathers or deferral, whole sharded rows in
  units, replicated rows elsewhere); ScheduleError naming the chunk or leaf.
  """
  f = s.fsdp
  if f is None:
    return
  if not isinstance(f, FsdpPlan):
    raise ScheduleError(f"schedule has fsdp={f!r:.60}; expected an FsdpPlan or None.")
  if s.gathers or s.links or any(b.defer for b in s.buckets):
    raise ScheduleError("an FSDP schedule (fsdp) has no dear gathers, no links and no deferral groups.")
  rows = s.rows
  if len(f.shard_dims) != len(rows) or len(f.gather_dtypes) not in (0, len(rows)):
    raise ScheduleError(f"the FSDP plan has {len(f.shard_dims)} shard_dims and {len(f.gather_dtypes)} gather_dtypes "
                        f"for {len(rows)} rows; plan again.")
  gdt = f.gather_dtypes or [None] * len(rows)
  bad = next((r for r, (d, g) in enumerate(zip(f.shard_dims, gdt)) if d is None and g is not None), None)
  if bad is not None:
    raise ScheduleError(f"the FSDP plan gathers leaf {rows[bad][0]!r} in {gdt[bad]}, but it is replicated; plan again.")
  chunks = s.chunks
  n = f.shard_count
  units = set(f.units)
  for u in f.units:
    if not 0 <= u < len(chunks):
      raise ScheduleError(f"the FSDP plan names chunk {u}, but the schedule has {len(chunks)} chunks.")
  for k, c in enumerate(chunks):
    for r, a, b in c.slices:
      path, shape, _ = rows[r]
      d = f.shard_dims[r]
      if k in units:
        if d is None:
          raise ScheduleError(f"FSDP bucket chunk{k} holds leaf {path!r}, which is replicated; a bucket "
                              f"holds sharded leaves only (replicated ones are all-reduced).")
        if (a, b) != (0, math.prod(shape)):
          raise ScheduleError(f"FSDP bucket chunk{k} holds [{a}:{b}] of leaf {path!r}; a bucket holds "
                              f"whole leaves (each device's slice is its shard of every leaf).")
        if not 0 <= d < len(shape) or shape[d] % n:
          raise ScheduleError(f"leaf {path!r} of shape {shape} cannot be split on dimension {d} over {n} "
                              f"devices.")
      elif d is not None:
        raise ScheduleError(f"chunk{k} holds sharded leaf {path!r} but is not an FSDP bucket (units); "
                            f"sharded leaves are reduce-scattered in their bucket.")
  if f.gathers:
    in_units = sorted(r for u in f.units for r, _, _ in chunks[u].slices)
    grouped = sorted(r for g in f.gathers for r in g)
    if grouped != in_units:
      extra = sorted(set(grouped) - set(in_units)) or sorted(set(in_units) - set(grouped))
      raise ScheduleError(f"the FSDP plan's gathers do not hold each row of its units exactly once (leaf "
                          f"{rows[extra[0]][0] if extra and extra[0] < len(rows) else '?'!r}); plan again.")
  for g, rs in enumerate(f.gathers or [[r for r, _, _ in chunks[u].slices] for u in f.units]):
    dtypes = {gdt[r] or rows[r][2] for r in rs}
    if len(dtypes) > 1:
      raise ScheduleError(f"FSDP gather group {g} mixes dtypes {sorted(dtypes)}; one all-gather gathers "
                          f"one dtype.")

