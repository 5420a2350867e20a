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
(`_tree.forward_paths`), not flatten order; `profile_from_trace`, without the loss, reads the order
from the compiled program (`_xplane.forward_positions`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from . import _xplane
from .._values._checks import check_bool, check_int
from .._values._errors import ProfileError
from .._values._tree import check_layer_depth, dtype_name, forward_paths, is_reduced_leaf, layer_of, layer_path, path_str
from .._values._types import GradientProfile, ProfileRow, itemsize

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


def _setup(loss_fn, params, batch, num_devices, layer_depth, mesh=None, axis_name=None) -> _Setup:
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  if not callable(loss_fn):
    raise TypeError(f"profile_step(loss_fn={loss_fn!r}): expected a callable loss_fn(params, batch).")
  check_layer_depth("profile_step", layer_depth)
  if mesh is None:
    devices = jax.local_devices()
  else:  # the training mesh: this process's devices along its data axis run the per-device step
    from .._compiled._devices import local_devices_along  # imports jax, which this module imports in functions

    if axis_name is None and len(mesh.axis_names) == 1:
      axis_name = mesh.axis_names[0]
    if axis_name is None:
      raise ValueError(f"profile_step(mesh=...): the mesh has axes {tuple(mesh.axis_names)}; name the one "
                       f"the batch is split over: axis_name=...")
    devices = local_devices_along(mesh, axis_name, "profile_step")
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
  layer_paths = [layer_path(p) for p, _ in flat]   # an nnx Variable's '.value' is not a layer
  layers = {i: layer_of(layer_paths[i], layer_depth) for i in diff_idx}

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


class _Prog:
  """A lowered program with its arguments: compiled once (several at once by `_compile_all`), then run
  by calling it."""

  def __init__(self, lowered: Any, args: Sequence[Any]):
    self.lowered = lowered
    self.args = tuple(args)
    self.compiled: Any = None

  def compile(self) -> _Prog:
    if self.compiled is None:
      self.compiled = self.lowered.compile()
    return self

  def __call__(self) -> Any:
    return self.compile().compiled(*self.args)


def _compile_all(progs: Sequence[_Prog | None]) -> None:
  """Compiles the programs at once: XLA releases the GIL while it compiles, so on a host with a few
  cores the gradient step, the local train step and the update compile in the time of the slowest."""
  todo = [p for p in progs if p is not None and p.compiled is None]
  if len(todo) <= 1:
    for p in todo:
      p.compile()
    return
  from concurrent.futures import ThreadPoolExecutor

  with ThreadPoolExecutor(len(todo)) as pool:
    for f in [pool.submit(p.compile) for p in todo]:
      f.result()


# --------------------------------------------------------------------------------------------------
# The three methods


@dataclasses.dataclass
class _RowSpec:
  """What a profile's rows are made of besides the timings (no jax): per gradient leaf k (flatten
  order of the float leaves, i.e. the grad program's output k) its path, shape, dtype and layer, and
  the priority (forward) order of the k."""

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


def _spec(s: _Setup) -> _RowSpec:
  leaves = [s.leaves[i] for i in s.diff_idx]
  return _RowSpec(paths=[s.paths[i] for i in s.diff_idx], shapes=[tuple(x.shape) for x in leaves],
                  dtypes=[str(x.dtype) for x in leaves], layers=[s.layers[i] for i in s.diff_idx],
                  order=list(s.order))


def _rows(spec: _RowSpec | _Setup, ready: Sequence[float], fwd_layer: Mapping[str, float], update_s: float
          ) -> tuple[ProfileRow, ...]:
  """Rows in priority order; `ready` is indexed like the spec's leaves (diff_idx)."""
  spec = _spec(spec) if isinstance(spec, _Setup) else spec
  total = max(sum(spec.nbytes(k) for k in range(len(spec.paths))), 1)
  rows, seen = [], set()
  for k in spec.order:
    layer = spec.layers[k]
    fwd = fwd_layer.get(layer, 0.0) if layer not in seen else 0.0
    seen.add(layer)
    nb = spec.nbytes(k)
    rows.append(ProfileRow(path=spec.paths[k], layer=layer, shape=tuple(spec.shapes[k]), dtype=spec.dtypes[k],
                           nbytes=nb, ready_s=float(ready[k]), fwd_s=float(fwd),
                           update_s=update_s * nb / total))
  return tuple(rows)


def _nbytes(x: Any) -> int:
  return int(math.prod(x.shape)) * itemsize(str(x.dtype))


def _layers_in_order(s: _Setup) -> list[str]:
  return list(dict.fromkeys(s.layers[s.diff_idx[k]] for k in s.order))


def _measured(s: _Setup, steps: int, warmup: int, update: _Prog | None, whole: _Prog | None,
              trace_dir: str | None) -> tuple[float, float, list[float], dict[str, float], float, str]:
  import jax

  diff, other = _split(s)
  grad = _Prog(_grad_program(s).lower(diff, other, s.batch), (diff, other, s.batch))
  _compile_all([grad, whole, update])
  compiled = grad.compiled
  text = compiled.as_text()
  hlo = _xplane.step_hlo(text)
  spec = _spec(s)
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
  upd_module = f"jit_{_UPDATE_NAME}"
  with tempfile.TemporaryDirectory(prefix="prophet_trace_") as tmp:
    d = trace_dir or tmp
    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 0  # the Python tracer would slow the steps and bloat the trace
    with jax.profiler.trace(d, profiler_options=opts):
      for _ in range(steps):
        jax.block_until_ready(compiled(diff, other, s.batch))
        if update is not None:
          jax.block_until_ready(update())
    if trace_dir:  # what profile_from_trace needs besides the trace
      with open(os.path.join(trace_dir, HLO_FILE), "w") as f:
        f.write(text)
    try:
      trace, an = _from_trace(d, hlo, spec, extra_modules=[upd_module], expected=steps * s.num_devices,
                              expected_why=f" ({steps} steps x {s.num_devices} devices)")
    except ProfileError as e:
      raise _NoProfilerEvents(str(e)) from None
  events = trace.events[hlo.module]
  backward_s, ready, fwd_layer = an.backward_s, an.ready_s, an.fwd_layer
  device_span = sum(fwd_layer.values()) + backward_s
  update_span = 0.0
  upd_events = trace.events.get(upd_module, []) if update is not None else []
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
  if scale < 0.1:
    raise _NoProfilerEvents(
        f"implausible trace: one device's traced step ({span * 1e3:.3f} ms) is {1 / scale:.0f} times the "
        f"untraced step ({wall_s * 1e3:.3f} ms); {an.held}")
  note = (f"measured: jax.profiler trace of {steps} steps x {s.num_devices} devices "
          f"({an.executions} executions, {_LINKED[trace.linked.get(hlo.module, 'run_id')]}), medians; ops "
          f"mapped to leaves via the ENTRY ROOT tuple, to layers via op_name metadata; one device's span "
          f"{device_span * 1e3:.3f} ms + update {update_span * 1e3:.3f} ms "
          f"({'traced' if upd_events else 'not measured'}) stretched x{scale:.2f} to the median untraced "
          f"wall clock of a step {wall_s * 1e3:.3f} ms (the synchronous step waits for the last device and "
          f"pays its launch; the traced envelope over devices was {envelope * 1e3:.3f} ms)")
  ready = [x * scale for x in ready]
  fwd_layer = {l: v * scale for l, v in fwd_layer.items()}
  update_s = update_span * scale
  return sum(fwd_layer.values()), backward_s * scale, ready, fwd_layer, update_s, note


HLO_FILE = "prophet_profile_step.hlo.txt"
_LINKED = {"run_id": "executions by run_id", "host launch": "executions by the host's launches",
           "segments": "executions cut where another program ran"}


def _from_trace(trace: str | os.PathLike[str], hlo: _xplane.StepHlo, spec: _RowSpec, *,
                outputs: Sequence[str] | None = None, extra_modules: Sequence[str] = (),
                expected: int | None = None, expected_why: str = "") -> tuple[_xplane.Trace, _xplane.Analysis]:
  """The trace's executions of the step `hlo`, analysed for the spec's rows (output k is leaf k; or
  `outputs[k]`): the one analysis behind `profile_step` and `profile_from_trace`.

  Raises:
    ProfileError: the trace holds no event of the step's module, or its profile is implausible
      (the message says what the trace held).
  """
  trace = _xplane.read_trace(trace, [hlo.module, *extra_modules])
  if not trace.events.get(hlo.module):
    seen = ", ".join(f"{m!r} ({k} events)" for m, k in sorted(trace.modules.items(), key=lambda kv: -kv[1])[:6])
    raise ProfileError(f"the profiler recorded no events of module {hlo.module!r} (the trace holds "
                       f"{seen or 'no XLA op events'})")
  if expected is None and hlo.module in trace.launches:  # the host's launches, on every device
    devices = len({e["device"] for e in trace.events[hlo.module]})
    expected = trace.launches[hlo.module] * devices
    expected_why = f" ({trace.launches[hlo.module]} host launches x {devices} devices)"
  n = len(spec.paths)
  an = _xplane.analyse(trace.events[hlo.module], hlo, list(range(n)), n, spec.layers_in_order,
                       outputs=outputs, expected=expected, expected_why=expected_why, row_layers=spec.layers)
  if an.problems:
    raise ProfileError(f"implausible trace: {'; '.join(an.problems)}; {an.held}")
  return trace, an


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
  # grad w.r.t. one layer alone: one compile per layer, so at most TIMED_LAYERS of them, evenly spaced
  # in forward order (the first and the last included); the layers between are interpolated by
  # parameter bytes, counted from the back (backward reaches them in that order)
  sampled = _sample(len(layers), TIMED_LAYERS)
  layer_ready = {}
  for j in sampled:
    ks = by_layer[layers[j]]
    g = _grad_program(s, wrt=ks, name=f"{_STEP_NAME}_part")
    t = _wall_median(lambda g=g: g(diff, other, s.batch), repeats)
    layer_ready[layers[j]] = min(max(t - t_fwd, 0.0), backward_s)
  if len(sampled) < len(layers):
    size = [sum(_nbytes(s.leaves[s.diff_idx[k]]) for k in by_layer[l]) for l in layers]
    back = [0.0] * len(layers)  # bytes from the back of the net to each layer's end
    acc = 0.0
    for j in range(len(layers) - 1, -1, -1):
      acc += size[j]
      back[j] = acc
    for a, b in zip(sampled, sampled[1:]):  # a in front of b; a is ready later
      for j in range(a + 1, b):
        w = (back[j] - back[b]) / (back[a] - back[b]) if back[a] > back[b] else (b - j) / (b - a)
        layer_ready[layers[j]] = layer_ready[layers[b]] + w * (layer_ready[layers[a]] - layer_ready[layers[b]])
  ready = [0.0] * len(s.diff_idx)
  for layer in layers:
    for k in by_layer[layer]:
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
  which = ("each layer" if len(sampled) == len(layers) else
           f"{len(sampled)} of the {len(layers)} layers (evenly spaced in forward order; the others "
           f"interpolated by parameter bytes)")
  note = (f"timed: wall-clock medians of {max(3, repeats)} runs of grad w.r.t. {which} alone minus the "
          f"forward ({t_fwd * 1e3:.3f} ms; includes dispatch); forward spread over layers by backward "
          f"segment")
  return t_fwd, backward_s, ready, fwd_layer, update_s, note


TIMED_LAYERS = 12  # at most this many per-layer gradient programs (each is compiled): BERT-base has 100 layers


def _sample(n: int, k: int) -> list[int]:
  """k indices of range(n) evenly spaced, the first and the last included (all of them when n <= k)."""
  if n <= k:
    return list(range(n))
  return sorted({round(j * (n - 1) / (k - 1)) for j in range(k)})


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
      be a global `jax.Array`). `axis_name` may be left out for a one-axis mesh.
    has_aux: `loss_fn` returns `(loss, aux)` (the loss `hooked(..., has_aux=True)` takes); only the
      loss is differentiated.
    has_state, model_state: `loss_fn(params, model_state, batch)` returns `(loss, new_model_state)` (or,
      with `has_aux`, `(loss, (new_model_state, aux))`), the loss `hooked`/`pipelined(...,
      has_state=True)` take; the step is profiled at `model_state` (e.g. BatchNorm statistics), which
      stays as it is.

  Returns:
    A GradientProfile with one row per floating leaf in forward (priority) order, exact shapes, dtypes
    and sizes; `ready_s` from the start of backward; `method` and `notes` say how it was made.

  Raises:
    TypeError: loss_fn is not callable, does not return a real scalar, or is not differentiable in
      params.
    ValueError: a batch leaf's leading axis is not divisible by num_devices, the batch does not fit the
      model, or too many devices are asked for.
    ProfileError: `method='measured'` but the profiler yielded no usable events, or a trace whose profile
      is implausible (the message says what the trace held); or no float params.

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
  if mesh is not None:  # host rows, sliced over the profiled devices below

    def host(x):
      if isinstance(x, jax.Array) and not x.is_fully_addressable:
        raise ValueError("profile_step(mesh=...): the batch holds a global array that spans processes; "
                         "pass the rows this process's devices train on (host data).")
      return jax.device_get(x)

    batch = jax.tree_util.tree_map(host, batch)
  s = _setup(loss_fn, params, batch, num_devices, layer_depth, mesh=mesh, axis_name=axis_name)
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
  import jax

  from .._compiled._hlo import hlo_text as _as_text

  text = _as_text(hlo_text)
  if "HloModule" not in text:
    raise ValueError(f"profile_from_trace: hlo_text is not HLO module text (it starts {text[:40]!r}); pass "
                     f"compiled.as_text() of the traced program (jax.jit(f).lower(...).compile()).")
  hlo = _xplane.step_hlo(text)
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
  outputs = _gradient_outputs(hlo, paths, shapes, dtypes)
  positions = None
  notes = []
  if all(_hlo_matches(hlo.instrs[hlo.params[k]].shape, shapes[k], dtypes[k]) if k in hlo.params else False
         for k in range(len(paths))):
    positions = _xplane.forward_positions(hlo, len(paths))
  if positions is None:
    order = list(range(len(paths)))
    notes.append("rows in flatten order (the program's first parameters are not the leaves of params, so "
                 "its forward order could not be read)")
  else:
    unread = len(paths) + max((p for p in positions if p is not None), default=0)
    order = sorted(range(len(paths)), key=lambda k: (positions[k] if positions[k] is not None else unread,
                                                     -math.prod(shapes[k]), k))
  spec = _RowSpec(paths=paths, shapes=shapes, dtypes=dtypes, layers=[layer_of(layer_of_path[p], layer_depth) for p in paths],
                  order=order)
  try:
    trace_read, an = _from_trace(trace, hlo, spec, outputs=outputs)
  except ProfileError as e:
    raise ProfileError(f"profile_from_trace({os.fspath(trace)!r}): {e}.") from None
  rows = _rows(spec, an.ready_s, an.fwd_layer, 0.0)
  fsum = sum(r.fwd_s for r in rows)
  note = (f"measured: profile_from_trace of {os.fspath(trace)}: {an.executions} executions "
          f"({_LINKED[trace_read.linked.get(hlo.module, 'run_id')]}) on {an.devices} device(s), medians on "
          f"the trace's clock; {an.held}; ops mapped to leaves via the ENTRY ROOT tuple, to layers via "
          f"op_name metadata; rows in the compiled forward's order of first use; update not in the "
          f"program (update_s 0)")
  return GradientProfile(rows=rows, forward_s=fsum if fsum > 0 else an.forward_s, backward_s=an.backward_s,
                         method="measured", model="", device=trace_read.device_name or trace_read.platform,
                         notes="; ".join(notes + [note]))


_HLO_DTYPES = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16", "complex64": "c64",
               "complex128": "c128"}


def _hlo_dtype(name: str) -> str:
  if name in _HLO_DTYPES:
    return _HLO_DTYPES[name]
  if name.startswith("float8_"):
    return "f8" + name[len("float8_"):]
  return name


def _hlo_matches(shape_text: str, shape: tuple[int, ...], dtype: str) -> bool:
  from .._compiled._hlo import shape_dims, shape_dtypes

  return shape_dims(shape_text) == (tuple(shape),) and shape_dtypes(shape_text) == (_hlo_dtype(dtype),)


def _gradient_outputs(hlo: _xplane.StepHlo, paths: Sequence[str], shapes: Sequence[tuple[int, ...]],
                      dtypes: Sequence[str]) -> list[str]:
  """The program outputs that are the gradient leaves: the one run of consecutive ENTRY ROOT operands
  whose shapes and dtypes are the leaves', in order."""
  outs = hlo.root_operands
  n = len(paths)
  fits = [off for off in range(len(outs) - n + 1)
          if all(_hlo_matches(hlo.instrs[outs[off + k]].shape, shapes[k], dtypes[k]) for k in range(n))]
  if len(fits) == 1:
    return list(outs[fits[0]:fits[0] + n])
  if len(fits) > 1:
    raise ValueError(f"profile_from_trace: the program's outputs hold the shapes of the {n} leaves of params "
                     f"at {len(fits)} places (outputs {fits[0]}.. and {fits[1]}..): cannot tell which are the "
                     f"gradients. Trace a program that returns the gradients alone (jax.grad), as "
                     f"profile_step does.")
  # name the first leaf that differs, against the best alignment (outputs 0.. or 1.. for value_and_grad)
  best, where = -1, 0
  for off in range(max(len(outs) - n + 1, 1)):
    k = 0
    while k < n and off + k < len(outs) and _hlo_matches(hlo.instrs[outs[off + k]].shape, shapes[k], dtypes[k]):
      k += 1
    if k > best:
      best, where = k, off
  got = hlo.instrs[outs[where + best]].shape if where + best < len(outs) else "nothing (too few outputs)"
  raise ValueError(
      f"profile_from_trace: the program {hlo.module!r} has {len(outs)} outputs; they do not match the {n} "
      f"floating leaves of params: leaf {paths[best]!r} ({dtypes[best]}{list(shapes[best])}) meets output "
      f"{where + best}, {got}. Pass the tree whose gradients the traced program returns (in its flatten "
      f"order), and the HLO text of that same program.")


def _update_program(s: _Setup, tx: Any) -> _Prog:
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
  return _Prog(f.lower(diff, grads, state), (diff, grads, state))


def _updater(tx: Any) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
  """(params, grads, opt_state) -> (params, opt_state): one step of `tx`."""
  import optax

  def upd(p, g, st):
    u, st = tx.update(g, st, p)
    return optax.apply_updates(p, u), st

  return upd


def _local_step_program(s: _Setup, tx: Any) -> _Prog:
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
  return _Prog(f.lower(diff, other, s.batch, state), (diff, other, s.batch, state))
