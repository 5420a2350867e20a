"""Per-leaf gradient readiness of a real training step -> GradientProfile.

Public API:
  profile_step(loss_fn, params, batch, *, num_devices=None, ...) -> GradientProfile
  profile_from_trace(trace, hlo_text, params, *, layer_depth=None) -> GradientProfile

How (`method='measured'`): the gradient step `jax.grad(loss_fn)` is compiled under `jax.shard_map` over
a 1-D mesh of `num_devices` devices (parameters replicated, the batch split on its leading axis, no
all-reduce: the same per-device program as training without its communication), run `warmup` times,
then `steps` times under `jax.profiler.trace`. The trace's XLA op events are grouped into executions
(one per step and device; `_xplane.read_trace`: XLA:CPU's events carry a `run_id`, XLA:GPU's kernels
are tied to the host's launch of the program through their `correlation_id`, every stream of a device
together) and mapped (`_xplane.analyse`, shared with `profile_from_trace`):

- to gradient leaves through the compiled HLO: output k of the ENTRY ROOT tuple is leaf k; following
  its operands through ops that have no event of their own (bitcast, copy, get-tuple-element of a
  tuple: that element only), the leaf is ready when the last op producing it ends;
- to forward or backward through each op's `op_name` metadata: backward ops are under `transpose(...)`;
  backward starts with the first of them;
- to layers through the same metadata (flax's module names in the name stack): each forward op's time
  (from the end of the previous op) goes to the layer its name matches, or to the layer before it.

Every number is the median over the `steps x num_devices` executions. A trace that gives an implausible
profile (executions that do not match the traced steps, backward under a tenth of forward, most layers
ready at one instant) is not used: 'measured' raises ProfileError saying what the trace held, 'auto'
falls back with a note saying why. Ready times are *not* in layer order where XLA schedules them
otherwise (it computes data gradients before large weight gradients).
The trace gives the timeline's *shape*; its length is the median untraced wall clock of a step
(gradients and `tx`'s update in one program, with no reduction), timed just before: a synchronous
data-parallel step waits for its slowest device and pays its launch, but not the profiler's own
overhead, which inflates traced ops on a loaded host. So one device's timeline (forward, backward,
update) is stretched to that wall clock: with one device per accelerator the factor is about 1; with
8 host devices sharing a few CPU cores it is several (the notes give it, and the traced envelope over
devices beside it). The optimizer update (`tx`) is a separate program in the same trace; its
stretched span is spread over the rows by bytes. The gradient step, the local train step and the
update compile at once (XLA releases the GIL while compiling).

Fallbacks, in order (`method='auto'`), each saying so in the profile's `method` and `notes`:
- `'timed'`: when the profiler yields no usable trace: the wall-clock median of `grad` with respect
  to one layer's parameters alone, minus the forward's, gives that layer's ready time (XLA prunes the
  backward below the layer); at most `TIMED_LAYERS` (12) layers are timed, evenly spaced in forward
  order, each one compile, and the layers between are interpolated by parameter bytes; forward time is
  spread over layers in proportion to their backward segments.
- `'estimated'`: when timing fails too: XLA's cost analysis (FLOPs of the forward and of the full
  gradient step) divided by a measured matmul throughput of the devices, spread over layers by bytes.
Made-up numbers are never labelled 'measured'.

Rows are in forward (priority) order: the order in which the loss's jaxpr first reads each parameter
(`_jaxpr.forward_paths`), not flatten order; `profile_from_trace`, without the loss, reads the order
from the compiled program (`_step_hlo.forward_positions`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import Literal
from jax.sharding import NamedSharding

from . import _step_hlo
from ._profile_harness import local_step_program, setup, update_program
from ._profile_methods import (HLO_FILE, TIMED_LAYERS, LINKED, NoProfilerEvents, RowSpec, estimated,
                               from_trace, measured, profile_rows, timed)
from ._profile_outputs import gradient_outputs, hlo_matches
from .._compiled._devices import host_rows
from .._compiled._jaxcompat import check_jaxpr_api
from .._compiled._hlo import hlo_text as _as_text
from .._values._checks import check_bool, check_int
from .._values._errors import ProfileError
from .._values._tree import check_layer_depth, dtype_name, is_reduced_leaf, layer_of, layer_path, path_str
from .._values._types import GradientProfile

__all__ = ["profile_step", "profile_from_trace", "scanned_stacks", "METHODS", "HLO_FILE", "TIMED_LAYERS"]

METHODS = ("auto", "measured", "timed", "estimated")

# --------------------------------------------------------------------------------------------------
# Public entry points


def profile_step(loss_fn: Callable[[Any, Any], Any], params: Any, batch: Any, *,
                 num_devices: int | None = None, steps: int = 20, warmup: int = 2, method: str = "auto",
                 tx: Any = None, layer_depth: int | None = None, model: str = "", device: str = "",
                 trace_dir: str | None = None, mesh: Any = None, axis_name: Any = None,
                 has_aux: bool = False, has_state: bool = False, model_state: Any = None) -> GradientProfile:
  """Profiles a real gradient step: per-leaf ready times and per-layer forward times.

  Args:
    loss_fn: `loss_fn(params, batch) -> scalar`, the per-device mean loss (as in training).
    params: the parameter pytree (integer leaves pass through; they are not rows).
    batch: the GLOBAL batch; every leaf's leading axis is split over `num_devices`.
    num_devices: devices on this host to map the step over (default all), as in training.
    steps: profiled steps (each gives `num_devices` executions; medians over all of them). The traced
      steps are cheap next to compilation; many of them make the medians robust to a loaded host.
    warmup: untimed steps first.
    method: 'auto' (measured, else timed, else estimated), or one of 'measured', 'timed',
      'estimated' to insist on it ('measured' raises ProfileError when the trace is unusable).
    tx: an optax GradientTransformation; when given, its update time is measured and spread over the
      rows by bytes (`update_s`), otherwise `update_s` is 0.
    layer_depth: key-path components naming a layer (default: all but the last, e.g. 'params/Dense_0').
    model, device: recorded in the profile (device defaults to the devices' kind).
    trace_dir: keep the profiler trace there (default: a temporary directory, removed), with the traced
      program's HLO text beside it (`prophet_profile_step.hlo.txt`): `profile_from_trace(trace_dir,
      hlo_text, params)` reads them again anywhere.
    mesh, axis_name: profile the step as it trains on this mesh (`hooked(..., mesh=)`, a plain
      `jax.jit` on global arrays): on this process's devices along the data axis `axis_name` (at the
      first index of any other axis; `num_devices` defaults to their number), each with its slice of
      `batch`, which holds the rows those devices train on (the global batch in one process; it may
      be a global `jax.Array`). `axis_name` may be left out for a one-axis mesh. With or without a
      mesh, the profiled step maps the batch over an axis of that name, so a model whose layers
      reduce over it (`nn.BatchNorm(axis_name="batch")` under `jax.pmap(..., axis_name="batch")`)
      runs as it trains.
    has_aux: `loss_fn` returns `(loss, aux)` (the loss `hooked(..., has_aux=True)` takes); only the
      loss is differentiated.
    has_state, model_state: `loss_fn(params, model_state, batch)` returns `(loss, new_model_state)` (or,
      with `has_aux`, `(loss, (new_model_state, aux))`), the loss `hooked`/`pipelined(...,
      has_state=True)` take; the step is profiled at `model_state` (e.g. BatchNorm statistics), which
      stays as it is.

  Returns:
    A GradientProfile with one row per floating leaf in forward (priority) order, exact shapes, dtypes
    and sizes; `ready_s` from the start of backward; `method` and `notes` say how it was made. When
    `params` are arrays placed with `NamedSharding`s that shard some floating leaf (e.g. `P("data",
    None)` on the training mesh, FSDP), the profile records that placement (`with_placement`: each
    row's `shard_dim`, the arrays' mesh shape, `shard_axes`), read from the arrays whether or not
    `mesh` is given; what is measured is the same (the programs replicate the params on their own
    mesh). Params that are all replicated give a profile without placement, as before. With a
    placement, each scanned stack of parameters (a `scan` over stacked leaves, `scanned_stacks`) sharded on
    another than its layer axis is planned per layer (`GradientProfile.unstacked`).

  Raises:
    TypeError: loss_fn is not callable, does not return a real scalar, or is not differentiable in
      params.
    ValueError: a batch leaf's leading axis is not divisible by num_devices, the batch does not fit the
      model, too many devices are asked for, or the loss reduces over an axis other than `axis_name`
      (the message names it).
    ProfileError: `method='measured'` but the profiler yielded no usable events, or a trace whose profile
      is implausible (the message says what the trace held); or no float params; or a placement a
      profile cannot hold (a leaf sharded on two dimensions or unevenly, named), before any compile.

  Example:
    >>> m = prophet_jax.models.get_model("mlp")                                   # doctest: +SKIP
    >>> p = m.init(jax.random.key(0)); b = m.make_batch(jax.random.key(1), 64)   # doctest: +SKIP
    >>> prof = profile_step(m.loss_fn, p, b, num_devices=8, steps=3)              # doctest: +SKIP
    >>> prof.method                                                               # doctest: +SKIP
    'measured'
  """
  if method not in METHODS:
    raise ValueError(f"profile_step(method={method!r}): expected one of {METHODS}.")
  for name, v, lo in (("steps", steps, 1), ("warmup", warmup, 0)):
    check_int("profile_step", name, v, lo=lo)
  check_bool("profile_step", "has_aux", has_aux)
  check_bool("profile_step", "has_state", has_state)
  if has_state:  # the loss hooked/pipelined(..., has_state=True) take, at this model state
    if model_state is None:
      raise TypeError("profile_step(has_state=True): pass model_state=, the state loss_fn(params, "
                      "model_state, batch) reads (e.g. BatchNorm statistics).")
    state_loss = loss_fn
    loss_fn = lambda p, b: state_loss(p, model_state, b)  # noqa: E731
    has_aux = True  # (loss, new_state) or (loss, (new_state, aux)): the loss first either way
  elif model_state is not None:
    raise TypeError("profile_step(model_state=...): given without has_state=True, so loss_fn(params, "
                    "batch) would never see it; pass has_state=True and write loss_fn(params, "
                    "model_state, batch) -> (loss, new_model_state).")
  if has_aux:  # the same loss hooked(..., has_aux=True) takes: profile its scalar
    aux_loss = loss_fn
    loss_fn = lambda p, b: aux_loss(p, b)[0]  # noqa: E731
  shardings = _sharded_placement(params)  # before any compile: a placement it cannot record fails fast
  batch = host_rows(batch, mesh, "profile_step")
  s = setup(loss_fn, params, batch, num_devices, layer_depth, mesh=mesh, axis_name=axis_name)
  update = update_program(s, tx) if tx is not None else None
  notes = []
  result = None
  if method in ("auto", "measured"):
    try:
      whole = local_step_program(s, tx) if tx is not None else None
      result = measured(s, int(steps), int(warmup), update, whole, trace_dir)
    except NoProfilerEvents as e:
      if method == "measured":
        raise ProfileError(f"profile_step(method='measured'): {e}. Use method='auto' to fall back to "
                           f"per-layer timing.") from None
      notes.append(f"profiler unusable ({e}); fell back to per-layer timing")
  got = "measured" if result is not None else None
  if result is None and method in ("auto", "timed"):
    try:
      result = timed(s, max(3, int(steps)), update)
      got = "timed"
    except Exception as e:  # noqa: BLE001 - the documented fallback
      if method == "timed":
        raise
      notes.append(f"timing failed ({type(e).__name__}: {e}); fell back to FLOP estimates")
  if result is None:
    result = estimated(s)
    got = "estimated"
  forward_s, backward_s, ready, fwd_layer, update_s, note = result
  rows = profile_rows(s, ready, fwd_layer, update_s)
  fsum = sum(r.fwd_s for r in rows)
  dev = device or jax.local_devices()[0].device_kind
  prof = GradientProfile(rows=rows, forward_s=fsum if fsum > 0 else forward_s, backward_s=backward_s,
                         method=got, model=model, device=dev,
                         notes="; ".join(notes + [note, f"{s.num_devices} devices"]))
  if shardings is None:
    return prof
  prof = prof.with_placement(params, shardings)
  stacks = [x for x in scanned_stacks(loss_fn, params, batch)   # FSDP plans a scanned stack per layer
            if all(r.shard_dim != 0 for r in prof.rows if r.path.startswith(x + "/"))]
  return prof.unstacked(stacks) if stacks else prof


def scanned_stacks(loss_fn: Callable[[Any, Any], Any], params: Any, batch: Any) -> tuple[str, ...]:
  """The prefixes of the scanned stacks `loss_fn(params, batch)` reads: per `scan` (`nn.scan`, `nnx.scan`,
  `jax.lax.scan`) whose xs are parameter leaves (through casts and calls), the shallowest path prefix that
  holds them and no other floating leaf."""
  check_jaxpr_api("profile_step")
  kp, treedef = jax.tree_util.tree_flatten_with_path(params)
  paths = [path_str(p) for p, _ in kp]
  floats = {p for p, (_, x) in zip(paths, kp) if is_reduced_leaf(x)}
  jx = jax.make_jaxpr(lambda xs, b: loss_fn(jax.tree_util.tree_unflatten(treedef, xs), b))(
      [x for _, x in kp], batch).jaxpr
  found: list[str] = []

  def walk(j: Any, leaf: dict[int, int]) -> None:
    for e in j.eqns:
      ins = [None if isinstance(v, Literal) else leaf.get(id(v)) for v in e.invars]
      if e.primitive.name in _RELABEL and len(e.invars) == len(e.outvars):
        leaf.update({id(o): i for o, i in zip(e.outvars, ins) if i is not None})
      elif e.primitive.name == "scan":
        got = sorted({paths[i] for i in ins[e.params["num_consts"] + e.params["num_carry"]:] if i is not None})
        parts = [p.split("/") for p in got]
        pre = "/".join(os.path.commonprefix(parts) if len(got) > 1 else parts[0][:-1] if got else [])
        under = lambda q: {p for p in floats if p.startswith(q + "/")}  # noqa: E731
        while "/" in pre and under(pre.rsplit("/", 1)[0]) <= set(got):   # the shallowest prefix holding them alone
          pre = pre.rsplit("/", 1)[0]
        if pre and under(pre) <= set(got):
          found.append(pre)
      else:
        sub = next((getattr(e.params[k], "jaxpr", e.params[k]) for k in ("jaxpr", "call_jaxpr", "fun_jaxpr")
                    if k in e.params), None)
        if sub is not None and hasattr(sub, "eqns") and len(sub.invars) == len(e.invars):
          walk(sub, {id(v): i for v, i in zip(sub.invars, ins) if i is not None})

  walk(jx, {id(v): i for i, v in enumerate(jx.invars[:len(kp)])})
  return tuple(dict.fromkeys(found))


_RELABEL = frozenset({"convert_element_type", "copy", "copy_p", "pvary", "pcast", "optimization_barrier",
                      "device_put"})


def _sharded_placement(params: Any) -> Any:
  """The params' placement, as `GradientProfile.from_params(shardings=)` takes it, when some floating
  leaf is sharded; None otherwise (then the profile carries no placement and its fingerprint is what it
  was before placement existed).

  Read from the arrays: a leaf's `NamedSharding` (its spec, and its mesh's shape for the profile's
  mesh); any other leaf (a host array, a single-device or other sharding) counts as replicated. The
  programs `profile_step` measures are unchanged by it: they replicate the params on their own 1-D mesh
  (`setup`), so the placement is recorded, never measured.

  Raises:
    ProfileError: a placement a profile cannot hold (a leaf split on two dimensions, unevenly, or
      sharded leaves over different axes), naming the leaf.
  """
  shardings = jax.tree_util.tree_map(
      lambda x: x.sharding if isinstance(getattr(x, "sharding", None), NamedSharding) else None, params)
  if not any(s is not None for s in jax.tree_util.tree_leaves(shardings, is_leaf=lambda x: x is None)):
    return None
  try:
    probe = GradientProfile.from_params(params, shardings=shardings)
  except ProfileError as e:
    raise ProfileError(f"profile_step: the params' shardings: {e} (pass host arrays, jax.device_get(params), "
                       f"to profile without a placement)") from None
  return shardings if any(r.shard_dim is not None for r in probe.rows) else None


def profile_from_trace(trace: str | os.PathLike[str], hlo_text: str, params: Any, *,
                       layer_depth: int | None = None) -> GradientProfile:
  """A measured GradientProfile from a kept `jax.profiler` trace of a compiled gradient step.

  For profiling on the cluster and planning elsewhere: trace a few steps of the program that
  computes the gradients (`profile_step(..., trace_dir=d)` keeps its trace in `d` and the program's
  HLO text in `d/prophet_profile_step.hlo.txt`; or trace your own `jax.jit(jax.grad(loss_fn))` and
  keep `jitted.lower(...).compile().as_text()`), copy the trace and the text, and read them here.
  Nothing runs: the trace is read with `jax.profiler.ProfileData`, which works without the device
  it was taken on.

  What it reads (docs/facts.md, "Profiler traces on a GPU"): the program's op events, grouped into
  executions (XLA:CPU's events carry a `run_id`; XLA:GPU's kernels are tied to the host's launch of
  the program through their `correlation_id`, every stream of a device together); output k of the
  ENTRY ROOT tuple is gradient leaf k, ready when the last op producing it ends; `transpose(...)` in
  an op's name marks backward; flax's module names in the name stack give each forward op's layer.
  Every number is the median over the executions, on the trace's own clock (`profile_step` also
  stretches it to the untraced step). The rows' priority order is where the compiled forward pass
  first reads each parameter (the first op reading it that also depends on the batch: the program's
  parameters after the gradient leaves). The optimizer's update is not in a gradient program:
  `update_s` is 0.

  Args:
    trace: the `.xplane.pb` file, or the directory given to `jax.profiler.trace` (every
      `.xplane.pb` under it is read: one per host).
    hlo_text: `compiled.as_text()` of the traced program (a compiled executable is accepted too).
      Its outputs must be the gradients, in the flatten order of `params`'s floating leaves (a
      `value_and_grad` program's loss beside them is fine); its first parameters the parameters, in
      the same order (else the rows keep flatten order, and the notes say so).
    params: the gradient (or parameter) tree: arrays or `jax.ShapeDtypeStruct`s; its floating leaves
      are the rows (integer and float0 leaves are not).
    layer_depth: key-path components naming a layer (default: all but the last).

  Returns:
    A GradientProfile with `method='measured'`, one row per floating leaf in forward order, `ready_s`
    from the start of backward, the per-layer forward times, and notes saying what the trace held.

  Raises:
    FileNotFoundError: no trace file at `trace`.
    TypeError: `hlo_text` is neither text nor a compiled executable; a leaf of `params` is no array.
    ValueError: `hlo_text` is not HLO module text; the program's outputs do not match the leaves of `params` (the message names the
      first leaf that differs and the program's output there).
    ProfileError: the trace holds no event of the program, or an implausible profile: executions
      that do not match the host's launches, backward under a tenth of forward, most layers ready at
      one instant (the message says what the trace held).

  Example:
    >>> prof = profile_step(loss_fn, params, batch, trace_dir="/tmp/t")     # doctest: +SKIP
    >>> hlo = open("/tmp/t/prophet_profile_step.hlo.txt").read()             # doctest: +SKIP
    >>> profile_from_trace("/tmp/t", hlo, params).method                     # doctest: +SKIP
    'measured'
  """
  text = _as_text(hlo_text)
  if "HloModule" not in text:
    raise ValueError(f"profile_from_trace: hlo_text is not HLO module text (it starts {text[:40]!r}); pass "
                     f"compiled.as_text() of the traced program (jax.jit(f).lower(...).compile()).")
  hlo = _step_hlo.step_hlo(text)
  check_layer_depth("profile_from_trace", layer_depth)
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  leaves = [(path_str(p), x) for p, x in flat if is_reduced_leaf(x)]
  layer_of_path = {path_str(p): layer_path(p) for p, x in flat if is_reduced_leaf(x)}
  for path, x in ((path_str(p), x) for p, x in flat):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"profile_from_trace: leaf {path!r} of params is a {type(x).__name__}; expected arrays "
                      f"or jax.ShapeDtypeStructs.")
  if not leaves:
    raise ProfileError("profile_from_trace: params have no floating-point leaves, so there is no gradient "
                       "to profile; pass the model's float parameters (or their ShapeDtypeStructs).")
  paths = [p for p, _ in leaves]
  shapes = [tuple(int(d) for d in x.shape) for _, x in leaves]
  dtypes = [dtype_name(x.dtype) for _, x in leaves]
  outputs = gradient_outputs(hlo, paths, shapes, dtypes)
  positions = None
  notes = []
  if all(hlo_matches(hlo.instrs[hlo.params[k]].shape, shapes[k], dtypes[k]) if k in hlo.params else False
         for k in range(len(paths))):
    positions = _step_hlo.forward_positions(hlo, len(paths))
  if positions is None:
    order = list(range(len(paths)))
    notes.append("rows in flatten order (the program's first parameters are not the leaves of params, so "
                 "its forward order could not be read)")
  else:
    unread = len(paths) + max((p for p in positions if p is not None), default=0)
    order = sorted(range(len(paths)), key=lambda k: (positions[k] if positions[k] is not None else unread,
                                                     -math.prod(shapes[k]), k))
  spec = RowSpec(paths=paths, shapes=shapes, dtypes=dtypes, layers=[layer_of(layer_of_path[p], layer_depth) for p in paths],
                  order=order)
  try:
    trace_read, an = from_trace(trace, hlo, spec, outputs=outputs)
  except ProfileError as e:
    raise ProfileError(f"profile_from_trace({os.fspath(trace)!r}): {e}.") from None
  rows = profile_rows(spec, an.ready_s, an.fwd_layer, 0.0)
  fsum = sum(r.fwd_s for r in rows)
  note = (f"measured: profile_from_trace of {os.fspath(trace)}: {an.executions} executions "
          f"({LINKED[trace_read.linked.get(hlo.module, 'run_id')]}) on {an.devices} device(s), medians on "
          f"the trace's clock; {an.held}; ops mapped to leaves via the ENTRY ROOT tuple, to layers via "
          f"op_name metadata; rows in the compiled forward's order of first use; update not in the "
          f"program (update_s 0)")
  return GradientProfile(rows=rows, forward_s=fsum if fsum > 0 else an.forward_s, backward_s=an.backward_s,
                         method="measured", model="", device=trace_read.device_name or trace_read.platform,
                         notes="; ".join(notes + [note]))
