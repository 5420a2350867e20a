"""Per-leaf gradient readiness of a real training step -> GradientProfile.

Public API:
  profile_step(loss_fn, params, batch, *, num_devices=None, ...) -> GradientProfile

How (`method='measured'`): the gradient step `jax.grad(loss_fn)` is compiled under `jax.shard_map` over
a 1-D mesh of `num_devices` devices (parameters replicated, the batch split on its leading axis, no
all-reduce: the same per-device program as training without its communication), run `warmup` times,
then `steps` times under `jax.profiler.trace`. The trace's XLA op events (`hlo_module`, `hlo_op`,
`run_id`, `device_ordinal`) are grouped into executions (one per step and device) and mapped
(`_xplane`):

- to gradient leaves through the compiled HLO: output k of the ENTRY ROOT tuple is leaf k; following
  its operands through ops that have no event of their own (bitcast, copy, get-tuple-element, tuple),
  the leaf is ready when the last op producing it ends;
- to forward or backward through each op's `op_name` metadata: backward ops are under `transpose(...)`;
  backward starts with the first of them;
- to layers through the same metadata (flax's module names in the name stack): each forward op's time
  (from the end of the previous op) goes to the layer its name matches, or to the layer before it.

Every number is the median over the `steps x num_devices` executions. Ready times are *not* in layer
order where XLA schedules them otherwise (it computes data gradients before large weight gradients).
The trace gives the timeline's *shape*; its length is the median untraced wall clock of a step
(gradients and `tx`'s update in one program, with no reduction), timed just before: a synchronous
data-parallel step waits for its slowest device and pays its launch, but not the profiler's own
overhead, which inflates traced ops on a loaded host. So one device's timeline (forward, backward,
update) is stretched to that wall clock: with one device per accelerator the factor is about 1; with
8 host devices sharing a few CPU cores it is several (the notes give it, and the traced envelope over
devices beside it). The optimizer update (`tx`) is a separate program in the same trace; its
stretched span is spread over the rows by bytes.

Fallbacks, in order (`method='auto'`), each saying so in the profile's `method` and `notes`:
- `'timed'`: when the profiler yields no events for the step (or they cannot be mapped): the
  wall-clock median of `grad` with respect to each layer's parameters alone, minus the forward's,
  gives that layer's ready time (XLA prunes the backward below the layer); forward time is spread
  over layers in proportion to their backward segments.
- `'estimated'`: when timing fails too: XLA's cost analysis (FLOPs of the forward and of the full
  gradient step) divided by a measured matmul throughput of the devices, spread over layers by bytes.
Made-up numbers are never labelled 'measured'.

Rows are in forward (priority) order: the order in which the loss's jaxpr first reads each parameter
(`_tree.forward_paths`), not flatten order.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from . import _xplane
from ._checks import check_int
from ._errors import ProfileError
from ._tree import forward_paths, is_reduced_leaf, layer_of, path_str
from ._types import GradientProfile, ProfileRow, itemsize

_AXIS = "prophet_profile"
_STEP_NAME = "prophet_profile_step"
_UPDATE_NAME = "prophet_profile_update"
METHODS = ("auto", "measured", "timed", "estimated")


# --------------------------------------------------------------------------------------------------
# Setup shared by every method


@dataclasses.dataclass
class _Setup:
  """Everything the methods share: the mesh, the sharded inputs, the rows and their order."""

  mesh: Any
  num_devices: int
  params: Any                 # replicated on the mesh
  batch: Any                  # sharded on the mesh
  diff_idx: list[int]         # flat indices of the differentiated (floating) leaves, flatten order
  treedef: Any
  leaves: list[Any]
  paths: list[str]            # flatten order
  order: list[int]            # indices into diff_idx, forward (priority) order
  layers: dict[int, str]      # flat index -> layer name
  loss_of: Callable[..., Any]  # (diff_leaves, other_leaves, batch) -> scalar


def _setup(loss_fn, params, batch, num_devices, layer_depth) -> _Setup:
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  if not callable(loss_fn):
    raise TypeError(f"profile_step(loss_fn={loss_fn!r}): expected a callable loss_fn(params, batch).")
  devices = jax.local_devices()
  n = len(devices) if num_devices is None else num_devices
  check_int("profile_step", "num_devices", n, lo=1)
  if n > len(devices):
    raise ValueError(f"profile_step(num_devices={n}): only {len(devices)} {devices[0].platform} device(s) "
                     f"here. On the CPU set XLA_FLAGS=--xla_force_host_platform_device_count={n} before "
                     f"jax starts.")
  n = int(n)
  mesh = jax.sharding.Mesh(np.asarray(devices[:n]), (_AXIS,))

  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  paths = [path_str(p) for p, _ in flat]
  leaves = [x for _, x in flat]
  for path, x in zip(paths, leaves):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"profile_step: parameter leaf {path!r} is a {type(x).__name__}; expected arrays.")
  diff_idx = [i for i, x in enumerate(leaves) if is_reduced_leaf(x)]
  if not diff_idx:
    raise ProfileError("profile_step: params have no floating-point leaves, so nothing is differentiable; "
                       "pass the model's float parameters.")
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

  def loss_of(diff_leaves, other_leaves, b):
    full, di, oi = [], iter(diff_leaves), iter(other_leaves)
    dset = set(diff_idx)
    for i in range(len(leaves)):
      full.append(next(di) if i in dset else next(oi))
    return loss_fn(jax.tree_util.tree_unflatten(treedef, full), b)

  # Abstract check: differentiable, scalar, batch shapes the model accepts (per-device shapes).
  diff = [leaves[i] for i in diff_idx]
  other = [x for i, x in enumerate(leaves) if i not in set(diff_idx)]
  local_batch = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct((x.shape[0] // n, *x.shape[1:]), x.dtype), batch)
  try:
    out = jax.eval_shape(loss_fn, params, local_batch)
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
    jax.eval_shape(jax.grad(loss_of), diff, other, local_batch)
  except Exception as e:  # noqa: BLE001
    raise TypeError(f"profile_step: loss_fn is not differentiable in params: {type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''}. Every floating parameter must reach the "
                    f"loss through differentiable operations.") from e

  # Forward (priority) order: first use in the loss's jaxpr.
  fwd = forward_paths(loss_fn, params, local_batch)
  pos = {p: k for k, p in enumerate(fwd)}
  order = sorted(range(len(diff_idx)), key=lambda k: (pos.get(paths[diff_idx[k]], len(pos)), k))
  layers = {i: layer_of(paths[i], layer_depth) for i in diff_idx}

  rep = NamedSharding(mesh, P())
  shard = NamedSharding(mesh, P(_AXIS))
  params_d = jax.device_put(params, rep)
  batch_d = jax.device_put(batch, shard)
  return _Setup(mesh=mesh, num_devices=n, params=params_d, batch=batch_d, diff_idx=diff_idx,
                treedef=treedef, leaves=list(jax.tree_util.tree_leaves(params_d)), paths=paths,
                order=order, layers=layers, loss_of=loss_of)


def _shapes(tree: Any) -> str:
  import jax

  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return "{" + ", ".join(f"{path_str(k) or 'batch'}: {tuple(x.shape)}" for k, x in flat) + "}"


def _split(s: _Setup) -> tuple[list[Any], list[Any]]:
  dset = set(s.diff_idx)
  return ([s.leaves[i] for i in s.diff_idx], [x for i, x in enumerate(s.leaves) if i not in dset])


def _grad_program(s: _Setup, wrt: Sequence[int] | None = None, name: str = _STEP_NAME):
  """jit(shard_map(grad)) over the mesh, with no all-reduce; `wrt` restricts to some diff leaves."""
  import jax
  from jax.sharding import PartitionSpec as P

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

  step.__name__ = name
  step.__qualname__ = name
  return jax.jit(jax.shard_map(step, mesh=s.mesh, in_specs=(P(), P(), P(_AXIS)), out_specs=P(),
                               check_vma=False))


def _loss_program(s: _Setup):
  import jax
  from jax.sharding import PartitionSpec as P

  def fwd(diff, other, b):
    return s.loss_of(diff, other, b)

  return jax.jit(jax.shard_map(fwd, mesh=s.mesh, in_specs=(P(), P(), P(_AXIS)), out_specs=P(),
                               check_vma=False))


def _wall_median(f: Callable[[], Any], repeats: int) -> float:
  import jax

  jax.block_until_ready(f())
  ts = []
  for _ in range(max(3, repeats)):
    t0 = time.perf_counter()
    jax.block_until_ready(f())
    ts.append(time.perf_counter() - t0)
  return float(statistics.median(ts))


# --------------------------------------------------------------------------------------------------
# The three methods


def _rows(s: _Setup, ready: Sequence[float], fwd_layer: Mapping[str, float], update_s: float
          ) -> tuple[ProfileRow, ...]:
  """Rows in priority order; `ready` is indexed like diff_idx."""
  total = max(sum(_nbytes(s.leaves[i]) for i in s.diff_idx), 1)
  rows, seen = [], set()
  for k in s.order:
    i = s.diff_idx[k]
    x = s.leaves[i]
    layer = s.layers[i]
    fwd = fwd_layer.get(layer, 0.0) if layer not in seen else 0.0
    seen.add(layer)
    nb = _nbytes(x)
    rows.append(ProfileRow(path=s.paths[i], layer=layer, shape=tuple(x.shape), dtype=str(x.dtype),
                           nbytes=nb, ready_s=float(ready[k]), fwd_s=float(fwd),
                           update_s=update_s * nb / total))
  return tuple(rows)


def _nbytes(x: Any) -> int:
  return int(math.prod(x.shape)) * itemsize(str(x.dtype))


def _layers_in_order(s: _Setup) -> list[str]:
  return list(dict.fromkeys(s.layers[s.diff_idx[k]] for k in s.order))


def _measured(s: _Setup, steps: int, warmup: int, update: Callable[[], Any] | None,
              whole: Callable[[], Any] | None, trace_dir: str | None
              ) -> tuple[float, float, list[float], dict[str, float], float, str]:
  import jax

  diff, other = _split(s)
  prog = _grad_program(s)
  compiled = prog.lower(diff, other, s.batch).compile()
  hlo = _xplane.step_hlo(compiled.as_text())
  if len(hlo.root_operands) != len(s.diff_idx):
    raise _NoProfilerEvents(f"the compiled step returns {len(hlo.root_operands)} outputs for {len(s.diff_idx)} "
                   f"gradient leaves; cannot map them")
  for _ in range(max(1, warmup)):
    jax.block_until_ready(compiled(diff, other, s.batch))
    if update is not None:
      jax.block_until_ready(update())
  run = whole or (lambda: compiled(diff, other, s.batch))  # the step: gradients and update, in one program
  jax.block_until_ready(run())
  walls = []  # wall-clock per step, outside the profiler: what a user's timer sees for the step
  for _ in range(steps):
    t0 = time.perf_counter()
    jax.block_until_ready(run())
    walls.append(time.perf_counter() - t0)
  wall_s = statistics.median(walls)
  with tempfile.TemporaryDirectory(prefix="prophet_trace_") as tmp:
    d = trace_dir or tmp
    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 0  # the Python tracer would slow the steps and bloat the trace
    with jax.profiler.trace(d, profiler_options=opts):
      for _ in range(steps):
        jax.block_until_ready(compiled(diff, other, s.batch))
        if update is not None:
          jax.block_until_ready(update())
    events = _xplane.op_events(d, hlo.module)
    upd_events = _xplane.op_events(d, f"jit_{_UPDATE_NAME}") if update is not None else []
  if not events:
    raise _NoProfilerEvents(f"the profiler recorded no events of module {hlo.module!r}")
  layers = _layers_in_order(s)
  results = [r for ex in _xplane.executions(events)
             if (r := _xplane.analyse_execution(ex, hlo, list(range(len(s.diff_idx))), len(s.diff_idx),
                                               layers)) is not None]
  if not results:
    raise _NoProfilerEvents(f"no execution of {hlo.module!r} in the trace had backward ops to map")
  backward_s = statistics.median(r[1] for r in results)
  ready = [statistics.median(r[2][k] for r in results) for k in range(len(s.diff_idx))]
  fwd_layer = {l: statistics.median(r[3][l] for r in results) for l in layers}
  device_span = sum(fwd_layer.values()) + backward_s
  update_span = 0.0
  if upd_events:  # one device's update span
    spans = [(ex[-1]["end_ns"] - ex[0]["start_ns"]) * 1e-9 for ex in _xplane.executions(upd_events) if ex]
    update_span = statistics.median(spans) if spans else 0.0
  # The trace gives the timeline's shape; its length is the untraced wall clock of a step (gradients
  # and update in one program, as a train step runs them): a synchronous data-parallel step waits for
  # its slowest device (8 host devices on a few cores start staggered and share cores), and pays its
  # launch, but not the tracer's own overhead, which inflates the traced ops on a loaded host.
  envelope = _xplane.median_envelope(events)
  span = device_span + update_span
  scale = wall_s / span if span > 0 else 1.0
  note = (f"measured: jax.profiler trace of {steps} steps x {s.num_devices} devices "
          f"({len(results)} executions), medians; ops mapped to leaves via the ENTRY ROOT tuple, to "
          f"layers via op_name metadata; one device's span {device_span * 1e3:.3f} ms + update "
          f"{update_span * 1e3:.3f} ms ({'traced' if upd_events else 'not measured'}) stretched x"
          f"{scale:.2f} to the median untraced wall clock of a step {wall_s * 1e3:.3f} ms (the "
          f"synchronous step waits for the last device and pays its launch; the traced envelope over "
          f"devices was {envelope * 1e3:.3f} ms)")
  ready = [x * scale for x in ready]
  fwd_layer = {l: v * scale for l, v in fwd_layer.items()}
  update_s = update_span * scale
  return sum(fwd_layer.values()), backward_s * scale, ready, fwd_layer, update_s, note


class _NoProfilerEvents(Exception):
  """The profiler trace could not be used (internal: triggers the fallback)."""


def _timed(s: _Setup, repeats: int, update: Callable[[], Any] | None
           ) -> tuple[float, float, list[float], dict[str, float], float, str]:
  diff, other = _split(s)
  fwd_prog = _loss_program(s)
  t_fwd = _wall_median(lambda: fwd_prog(diff, other, s.batch), repeats)
  full = _grad_program(s)
  t_all = _wall_median(lambda: full(diff, other, s.batch), repeats)
  backward_s = max(t_all - t_fwd, 0.0)
  layers = _layers_in_order(s)
  by_layer: dict[str, list[int]] = {}
  for k in range(len(s.diff_idx)):
    by_layer.setdefault(s.layers[s.diff_idx[k]], []).append(k)
  ready = [0.0] * len(s.diff_idx)
  layer_ready = {}
  for layer in layers:
    ks = by_layer[layer]
    g = _grad_program(s, wrt=ks, name=f"{_STEP_NAME}_part")
    t = _wall_median(lambda g=g: g(diff, other, s.batch), repeats)
    layer_ready[layer] = min(max(t - t_fwd, 0.0), backward_s)
    for k in ks:
      ready[k] = layer_ready[layer]
  # forward per layer: in proportion to each layer's backward segment (ready-time gaps, back to front)
  by_ready = sorted(layers, key=lambda l: layer_ready[l])
  seg, prev = {}, 0.0
  for l in by_ready:
    seg[l] = max(layer_ready[l] - prev, 0.0)
    prev = max(prev, layer_ready[l])
  tot = sum(seg.values())
  fwd_layer = {l: t_fwd * (seg[l] / tot if tot > 0 else 1 / len(layers)) for l in layers}
  update_s = _wall_median(update, repeats) if update is not None else 0.0
  note = (f"timed: wall-clock medians of {max(3, repeats)} runs of grad w.r.t. each layer alone minus the "
          f"forward ({t_fwd * 1e3:.3f} ms; includes dispatch); forward spread over layers by backward "
          f"segment")
  return t_fwd, backward_s, ready, fwd_layer, update_s, note


def _device_flops_per_s(s: _Setup) -> float:
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  m = 256
  a = jnp.ones((s.num_devices * m, m), jnp.float32)
  f = jax.jit(jax.shard_map(lambda x: x @ x.T[:, :m], mesh=s.mesh, in_specs=P(_AXIS),
                            out_specs=P(_AXIS), check_vma=False))
  a = jax.device_put(a, jax.sharding.NamedSharding(s.mesh, P(_AXIS)))
  t = _wall_median(lambda: f(a), 5)
  return 2 * m * m * m / max(t, 1e-9)


def _flops(compiled: Any) -> float:
  ca = compiled.cost_analysis()
  if isinstance(ca, (list, tuple)):
    ca = ca[0] if ca else {}
  return float((ca or {}).get("flops", 0.0))


def _estimated(s: _Setup) -> tuple[float, float, list[float], dict[str, float], float, str]:
  diff, other = _split(s)
  f_fwd = _flops(_loss_program(s).lower(diff, other, s.batch).compile())
  f_all = _flops(_grad_program(s).lower(diff, other, s.batch).compile())
  rate = _device_flops_per_s(s)
  forward_s = f_fwd / rate
  backward_s = max(f_all - f_fwd, 0.0) / rate
  # spread by bytes: later layers ready first
  layers = _layers_in_order(s)
  lb = dict.fromkeys(layers, 0)
  for k in range(len(s.diff_idx)):
    lb[s.layers[s.diff_idx[k]]] += _nbytes(s.leaves[s.diff_idx[k]])
  total = max(sum(lb.values()), 1)
  t, lr = 0.0, {}
  for l in reversed(layers):
    t += backward_s * lb[l] / total
    lr[l] = min(t, backward_s)
  ready = [lr[s.layers[s.diff_idx[k]]] for k in range(len(s.diff_idx))]
  fwd_layer = {l: forward_s * lb[l] / total for l in layers}
  note = (f"estimated: XLA cost analysis ({f_fwd:.3g} forward, {f_all:.3g} gradient-step FLOPs) / a "
          f"measured matmul throughput of {rate / 1e9:.2f} GFLOP/s per device; spread over layers by bytes")
  return forward_s, backward_s, ready, fwd_layer, 0.0, note


# --------------------------------------------------------------------------------------------------
# Public entry points


def profile_step(loss_fn: Callable[[Any, Any], Any], params: Any, batch: Any, *,
                 num_devices: int | None = None, steps: int = 20, warmup: int = 2, method: str = "auto",
                 tx: Any = None, layer_depth: int | None = None, model: str = "", device: str = "",
                 trace_dir: str | None = None) -> GradientProfile:
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
    trace_dir: keep the profiler trace there (default: a temporary directory, removed).

  Returns:
    A GradientProfile with one row per floating leaf in forward (priority) order, exact shapes, dtypes
    and sizes; `ready_s` from the start of backward; `method` and `notes` say how it was made.

  Raises:
    TypeError: loss_fn is not callable, does not return a real scalar, or is not differentiable in
      params.
    ValueError: a batch leaf's leading axis is not divisible by num_devices, the batch does not fit the
      model, or too many devices are asked for.
    ProfileError: `method='measured'` but the profiler yielded no usable events; or no float params.

  Example:
    >>> m = prophet_jax.models.get_model("mlp")                                   # doctest: +SKIP
    >>> p = m.init(jax.random.key(0)); b = m.make_batch(jax.random.key(1), 64)   # doctest: +SKIP
    >>> prof = profile_step(m.loss_fn, p, b, num_devices=8, steps=3)              # doctest: +SKIP
    >>> prof.method                                                               # doctest: +SKIP
    'measured'
  """
  import jax

  if method not in METHODS:
    raise ValueError(f"profile_step(method={method!r}): expected one of {METHODS}.")
  for name, v, lo in (("steps", steps, 1), ("warmup", warmup, 0)):
    check_int("profile_step", name, v, lo=lo)
  s = _setup(loss_fn, params, batch, num_devices, layer_depth)
  update = _update_program(s, tx) if tx is not None else None
  notes = []
  result = None
  if method in ("auto", "measured"):
    try:
      whole = _local_step_program(s, tx) if tx is not None else None
      result = _measured(s, int(steps), int(warmup), update, whole, trace_dir)
    except _NoProfilerEvents as e:
      if method == "measured":
        raise ProfileError(f"profile_step(method='measured'): {e}. Use method='auto' to fall back to "
                           f"per-layer timing.") from None
      notes.append(f"profiler unusable ({e}); fell back to per-layer timing")
  got = "measured" if result is not None else None
  if result is None and method in ("auto", "timed"):
    try:
      result = _timed(s, max(3, int(steps)), update)
      got = "timed"
    except Exception as e:  # noqa: BLE001 - the documented fallback
      if method == "timed":
        raise
      notes.append(f"timing failed ({type(e).__name__}: {e}); fell back to FLOP estimates")
  if result is None:
    result = _estimated(s)
    got = "estimated"
  forward_s, backward_s, ready, fwd_layer, update_s, note = result
  rows = _rows(s, ready, fwd_layer, update_s)
  fsum = sum(r.fwd_s for r in rows)
  dev = device or jax.local_devices()[0].device_kind
  return GradientProfile(rows=rows, forward_s=fsum if fsum > 0 else forward_s, backward_s=backward_s,
                         method=got, model=model, device=dev,
                         notes="; ".join(notes + [note, f"{s.num_devices} devices"]))


def _update_program(s: _Setup, tx: Any) -> Callable[[], Any]:
  import jax
  from jax.sharding import PartitionSpec as P

  if not hasattr(tx, "init") or not hasattr(tx, "update"):
    raise TypeError(f"profile_step(tx={tx!r}): expected an optax GradientTransformation (init/update).")

  diff, _ = _split(s)
  state = tx.init(diff)
  upd = _updater(tx)
  upd.__name__ = _UPDATE_NAME
  upd.__qualname__ = _UPDATE_NAME
  f = jax.jit(jax.shard_map(upd, mesh=s.mesh, in_specs=(P(), P(), P()), out_specs=(P(), P()),
                            check_vma=False))
  grads = jax.tree_util.tree_map(lambda x: x * 0 + 1e-3, diff)
  return lambda: f(diff, grads, state)


def _updater(tx: Any) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
  """(params, grads, opt_state) -> (params, opt_state): one step of `tx`."""
  import optax

  def upd(p, g, st):
    u, st = tx.update(g, st, p)
    return optax.apply_updates(p, u), st

  return upd


def _local_step_program(s: _Setup, tx: Any) -> Callable[[], Any]:
  """A train step with no reduction (gradients, then `tx`'s update, in one program): the step's cost
  with free communication."""
  import jax
  from jax.sharding import PartitionSpec as P

  diff, other = _split(s)
  state = tx.init(diff)
  upd = _updater(tx)

  def local_step(p, o, b, st):
    return upd(p, jax.grad(s.loss_of)(p, o, b), st)

  f = jax.jit(jax.shard_map(local_step, mesh=s.mesh, in_specs=(P(), P(), P(_AXIS), P()),
                            out_specs=(P(), P()), check_vma=False))
  return lambda: f(diff, other, s.batch, state)
