"""The three ways `profile_step` times a gradient step (measured, timed, estimated), and the rows they make."""

from __future__ import annotations

import functools
import itertools
import os
import statistics
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import _step_hlo, _xplane
from ._profile_harness import (UPDATE_NAME, STEP_NAME, Prog, ProgramSetup, RowSpec, compile_all, grad_program,
                               loss_program, mapped, split_leaves, wall_median)
from .._values._errors import ProfileError
from .._values._types import GradientProfile, ProfileRow, spread_by_bytes


def as_profile(spec: RowSpec, ready: Sequence[float], fwd_layer: Mapping[str, float], update_s: float,
               forward_s: float, backward_s: float, **fields: Any) -> GradientProfile:
  """The profile of these timings: rows in priority order (`ready` indexed like the spec's leaves), the
  forward time the layers' sum (`forward_s` where they have none), `fields` the rest (method, notes...)."""
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
  fsum = sum(r.fwd_s for r in rows)
  return GradientProfile(rows=tuple(rows), forward_s=fsum if fsum > 0 else forward_s, backward_s=backward_s,
                         **fields)


def measured(s: ProgramSetup, steps: int, warmup: int, update: Prog | None, whole: Prog | None,
              trace_dir: str | None) -> tuple[float, float, list[float], dict[str, float], float, str]:
  args = (*split_leaves(s), s.batch)
  grad = Prog(grad_program(s).lower(*args), args)
  compile_all([grad, whole, update])
  text = grad.compiled.as_text()
  hlo = _step_hlo.step_hlo(text)
  if len(hlo.root_operands) != len(s.diff_idx):
    raise NoProfilerEvents(f"the compiled step returns {len(hlo.root_operands)} outputs for {len(s.diff_idx)} "
                           f"gradient leaves; cannot map them")

  def traced_step():  # the gradients, then the update as a program of its own
    jax.block_until_ready(grad())
    if update is not None:
      jax.block_until_ready(update())

  for _ in range(max(1, warmup)):
    traced_step()
  # the wall clock of a step outside the profiler (gradients and update in one program): what a user's timer sees
  wall_s = wall_median(whole or grad, steps, least=1)
  upd_module = f"jit_{UPDATE_NAME}"
  with tempfile.TemporaryDirectory(prefix="prophet_trace_") as tmp:
    d = trace_dir or tmp
    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 0  # the Python tracer would slow the steps and bloat the trace
    with jax.profiler.trace(d, profiler_options=opts):
      for _ in range(steps):
        traced_step()
    if trace_dir:  # what profile_from_trace needs besides the trace
      with open(os.path.join(trace_dir, HLO_FILE), "w") as f:
        f.write(text)
    try:
      trace, an = from_trace(d, hlo, s.rows, extra_modules=[upd_module], expected=steps * s.num_devices,
                              expected_why=f" ({steps} steps x {s.num_devices} devices)")
    except ProfileError as e:
      raise NoProfilerEvents(str(e)) from None
  device_span = sum(an.fwd_layer.values()) + an.backward_s
  upd_events = trace.events.get(upd_module, []) if update is not None else []
  spans = [(ex[-1]["end_ns"] - ex[0]["start_ns"]) * 1e-9 for ex in _xplane.executions(upd_events) if ex]
  update_span = statistics.median(spans) if spans else 0.0   # one device's update span
  # The trace gives the timeline's shape; its length is the untraced wall clock of a step (gradients
  # and update in one program, as a train step runs them): a synchronous data-parallel step waits for
  # its slowest device (8 host devices on a few cores start staggered and share cores), and pays its
  # launch, but not the tracer's own overhead, which inflates the traced ops on a loaded host.
  envelope = _xplane.median_envelope(trace.events[hlo.module])
  span = device_span + update_span
  scale = wall_s / span if span > 0 else 1.0
  if scale < 0.1:
    raise NoProfilerEvents(
        f"implausible trace: one device's traced step ({span * 1e3:.3f} ms) is {1 / scale:.0f} times the "
        f"untraced step ({wall_s * 1e3:.3f} ms); {an.held}")
  note = (f"measured: jax.profiler trace of {steps} steps x {s.num_devices} devices "
          f"({an.executions} executions, {LINKED[trace.linked.get(hlo.module, 'run_id')]}), medians; ops "
          f"mapped to leaves via the ENTRY ROOT tuple, to layers via op_name metadata; one device's span "
          f"{device_span * 1e3:.3f} ms + update {update_span * 1e3:.3f} ms "
          f"({'traced' if upd_events else 'not measured'}) stretched x{scale:.2f} to the median untraced "
          f"wall clock of a step {wall_s * 1e3:.3f} ms (the synchronous step waits for the last device and "
          f"pays its launch; the traced envelope over devices was {envelope * 1e3:.3f} ms)")
  fwd_layer = {l: v * scale for l, v in an.fwd_layer.items()}
  return sum(fwd_layer.values()), an.backward_s * scale, [x * scale for x in an.ready_s], fwd_layer, \
      update_span * scale, note


HLO_FILE = "prophet_profile_step.hlo.txt"
LINKED = {"run_id": "executions by run_id", "host launch": "executions by the host's launches",
           "segments": "executions cut where another program ran"}


def from_trace(trace: str | os.PathLike[str], hlo: _step_hlo.StepHlo, spec: RowSpec, *,
                outputs: Sequence[str] | None = None, extra_modules: Sequence[str] = (),
                expected: int | None = None, expected_why: str = "") -> tuple[_xplane.Trace, _xplane.Analysis]:
  """The trace's executions of the step `hlo`, analysed for the rows; ProfileError for no or an implausible one."""
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


class NoProfilerEvents(Exception):
  """The profiler trace could not be used (internal: triggers the fallback)."""


def timed(s: ProgramSetup, repeats: int, update: Callable[[], Any] | None
           ) -> tuple[float, float, list[float], dict[str, float], float, str]:
  args = (*split_leaves(s), s.batch)
  t_fwd = wall_median(functools.partial(loss_program(s), *args), repeats)
  backward_s = max(wall_median(functools.partial(grad_program(s), *args), repeats) - t_fwd, 0.0)
  spec = s.rows
  layers, layer_bytes = spec.layers_in_order, spec.layer_bytes()
  by_layer: dict[str, list[int]] = {}
  for k, layer in enumerate(spec.layers):
    by_layer.setdefault(layer, []).append(k)
  # grad w.r.t. one layer alone: one compile per layer, so at most TIMED_LAYERS of them, evenly spaced
  # in forward order (the first and the last included); the layers between are interpolated by
  # parameter bytes, counted from the back (backward reaches them in that order)
  sampled = _sample(len(layers), TIMED_LAYERS)
  layer_ready = {}
  for j in sampled:
    g = grad_program(s, wrt=by_layer[layers[j]], name=f"{STEP_NAME}_part")
    layer_ready[layers[j]] = min(max(wall_median(functools.partial(g, *args), repeats) - t_fwd, 0.0), backward_s)
  back = list(itertools.accumulate(layer_bytes[l] for l in reversed(layers)))[::-1]  # from the back to its end
  for a, b in zip(sampled, sampled[1:]):  # a in front of b; a is ready later; the layers between interpolated
    for j in range(a + 1, b):
      w = (back[j] - back[b]) / (back[a] - back[b]) if back[a] > back[b] else (b - j) / (b - a)
      layer_ready[layers[j]] = layer_ready[layers[b]] + w * (layer_ready[layers[a]] - layer_ready[layers[b]])
  ready = [layer_ready[layer] for layer in spec.layers]
  # forward per layer: in proportion to each layer's backward segment (ready-time gaps, back to front)
  seg, prev = {}, 0.0   # ready times are >= 0, so in their order each gap is too
  for l in sorted(layers, key=lambda l: layer_ready[l]):
    seg[l], prev = layer_ready[l] - prev, layer_ready[l]
  tot = sum(seg.values())
  fwd_layer = {l: t_fwd * (seg[l] / tot if tot > 0 else 1 / len(layers)) for l in layers}
  update_s = wall_median(update, repeats) if update is not None else 0.0
  which = ("each layer" if len(sampled) == len(layers) else
           f"{len(sampled)} of the {len(layers)} layers (evenly spaced in forward order; the others "
           f"interpolated by parameter bytes)")
  note = (f"timed: wall-clock medians of {max(3, repeats)} runs of grad w.r.t. {which} alone minus the "
          f"forward ({t_fwd * 1e3:.3f} ms; includes dispatch); forward spread over layers by backward "
          f"segment")
  return t_fwd, backward_s, ready, fwd_layer, update_s, note


TIMED_LAYERS = 12  # at most this many per-layer gradient programs (each is compiled): BERT-base has 100 layers


def _sample(n: int, k: int) -> list[int]:
  return list(range(n)) if n <= k else sorted({round(j * (n - 1) / (k - 1)) for j in range(k)})


def _device_flops_per_s(s: ProgramSetup) -> float:
  m = 256
  a = jnp.ones((s.num_devices * m, m), jnp.float32)
  f = mapped(s, lambda x: x @ x.T[:, :m], P(s.axis), P(s.axis))
  a = jax.device_put(a, jax.sharding.NamedSharding(s.mesh, P(s.axis)))
  return 2 * m * m * m / max(wall_median(lambda: f(a), 5), 1e-9)


def _flops(compiled: Any) -> float:
  ca = compiled.cost_analysis()
  if isinstance(ca, (list, tuple)):
    ca = ca[0] if ca else {}
  return float((ca or {}).get("flops", 0.0))


def estimated(s: ProgramSetup) -> tuple[float, float, list[float], dict[str, float], float, str]:
  args = (*split_leaves(s), s.batch)
  f_fwd = _flops(loss_program(s).lower(*args).compile())
  f_all = _flops(grad_program(s).lower(*args).compile())
  rate = _device_flops_per_s(s)
  forward_s = f_fwd / rate
  backward_s = max(f_all - f_fwd, 0.0) / rate
  # spread by bytes: later layers ready first
  lr, fwd_layer = spread_by_bytes(s.rows.layer_bytes(), forward_s, backward_s)
  ready = [lr[layer] for layer in s.rows.layers]
  note = (f"estimated: XLA cost analysis ({f_fwd:.3g} forward, {f_all:.3g} gradient-step FLOPs) / a "
          f"measured matmul throughput of {rate / 1e9:.2f} GFLOP/s per device; spread over layers by bytes")
  return forward_s, backward_s, ready, fwd_layer, 0.0, note
