"""Per-leaf gradient readiness of a real training step (docs/design.md, "Measuring a step and the network")."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import Literal
from jax.sharding import NamedSharding

from . import _step_hlo
from ._profile_harness import RowSpec, float_leaves, local_step_program, setup, update_program
from ._profile_methods import LINKED, NoProfilerEvents, as_profile, estimated, from_trace, measured, timed
from .._compiled._devices import host_rows
from .._compiled._jaxcompat import check_jaxpr_api, scan_parts
from .._compiled._hlo import hlo_text as _as_text
from .._values._checks import check_bool, check_int, check_values
from .._values._errors import ProfileError
from .._values._tree import check_layer_depth, dtype_name, is_reduced_leaf, layer_of, layer_path, path_str
from .._values._types import GradientProfile

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
    steps, warmup: profiled steps (medians over `steps x num_devices` executions); untimed steps first.
    method: 'auto' (measured, else timed, else estimated), or 'measured', 'timed', 'estimated' to insist.
    tx: an optax GradientTransformation whose update time is spread over the rows (`update_s`; else 0).
    layer_depth: key-path components naming a layer (default: all but the last, e.g. 'params/Dense_0').
    model, device: recorded in the profile (device defaults to the devices' kind).
    trace_dir: keep the profiler trace there, with the program's HLO text, for `profile_from_trace`.
    mesh, axis_name: profile the step as it trains on this mesh, along its data axis `axis_name`.
    has_aux, has_state, model_state: `loss_fn` returns `(loss, aux)`; or takes `(params, model_state,
      batch)` and returns `(loss, new_model_state)`, profiled at `model_state` (as `hooked` takes it).

  Returns:
    A GradientProfile, one row per floating leaf in forward (priority) order, `ready_s` from the start of
    backward, `method` and `notes` saying how it was made; with the params' placement where they are
    sharded `NamedSharding`s (FSDP), each scanned stack sharded off its layer axis planned per layer
    (`scanned_stacks`, `GradientProfile.unstacked`).

  Raises:
    TypeError: loss_fn not callable, not a real scalar, or not differentiable in params.
    ValueError: a batch that does not split over num_devices or fit the model, too many devices, or a loss
      reducing over an axis other than `axis_name` (named).
    ProfileError: `method='measured'` and an unusable or implausible trace (what it held); no float
      params; a placement a profile cannot hold.

  Example:
    >>> m = prophet_jax.models.get_model("mlp")                                   # doctest: +SKIP
    >>> p = m.init(jax.random.key(0)); b = m.make_batch(jax.random.key(1), 64)   # doctest: +SKIP
    >>> profile_step(m.loss_fn, p, b, num_devices=8, steps=3).method              # doctest: +SKIP
    'measured'
  """
  if method not in METHODS:
    raise ValueError(f"profile_step(method={method!r}): expected one of {METHODS}.")
  steps = check_int("profile_step", "steps", steps, lo=1)
  warmup = check_int("profile_step", "warmup", warmup, lo=0)
  check_bool("profile_step", "has_aux", has_aux)
  check_bool("profile_step", "has_state", has_state)
  check_values("profile_step", loss_fn=loss_fn, **({} if tx is None else {"tx": tx}))
  if has_state and model_state is None:
    raise TypeError("profile_step(has_state=True): pass model_state=, the state loss_fn(params, "
                    "model_state, batch) reads (e.g. BatchNorm statistics).")
  if model_state is not None and not has_state:
    raise TypeError("profile_step(model_state=...): given without has_state=True, so loss_fn(params, "
                    "batch) would never see it; pass has_state=True and write loss_fn(params, "
                    "model_state, batch) -> (loss, new_model_state).")
  user_loss = loss_fn  # the loss hooked/pipelined take: with has_state or has_aux, profile its scalar
  if has_state:  # (loss, new_state) or (loss, (new_state, aux)), at this model state
    loss_fn = lambda p, b: user_loss(p, model_state, b)[0]  # noqa: E731
  elif has_aux:
    loss_fn = lambda p, b: user_loss(p, b)[0]  # noqa: E731
  shardings = _sharded_placement(params)  # before any compile: a placement it cannot record fails fast
  batch = host_rows(batch, mesh, "profile_step")
  s = setup(loss_fn, params, batch, num_devices, layer_depth, mesh=mesh, axis_name=axis_name)
  update = update_program(s, tx) if tx is not None else None
  notes, result, got = [], None, "measured"
  if method in ("auto", "measured"):
    try:
      whole = local_step_program(s, tx) if tx is not None else None
      result = measured(s, steps, warmup, update, whole, trace_dir)
    except NoProfilerEvents as e:
      if method == "measured":
        raise ProfileError(f"profile_step(method='measured'): {e}. Use method='auto' to fall back to "
                           f"per-layer timing.") from None
      notes.append(f"profiler unusable ({e}); fell back to per-layer timing")
  if result is None and method in ("auto", "timed"):
    got = "timed"
    try:
      result = timed(s, max(3, steps), update)
    except Exception as e:  # noqa: BLE001 - the documented fallback
      if method == "timed":
        raise
      notes.append(f"timing failed ({type(e).__name__}: {e}); fell back to FLOP estimates")
  if result is None:
    result, got = estimated(s), "estimated"
  forward_s, backward_s, ready, fwd_layer, update_s, note = result
  prof = as_profile(s.rows, ready, fwd_layer, update_s, forward_s, backward_s, method=got, model=model,
                    device=device or jax.local_devices()[0].device_kind,
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
        got = sorted({paths[i] for i in ins[sum(scan_parts(e)):] if i is not None})
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
  """The params' shardings when a floating leaf is sharded (recorded, never measured), else None."""
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

  Nothing runs: profile on the cluster, plan anywhere (docs/design.md, "`profile_from_trace`").

  Args:
    trace: the `.xplane.pb` file (gzipped or not), or the directory given to `jax.profiler.trace`.
    hlo_text: `compiled.as_text()` of the traced program (or the compiled executable), whose outputs are
      the gradients of `params`'s floating leaves in flatten order.
    params: the gradient (or parameter) tree, arrays or `jax.ShapeDtypeStruct`s.
    layer_depth: key-path components naming a layer (default: all but the last).

  Returns:
    A GradientProfile with `method='measured'`, rows in the compiled forward's order, on the trace's clock.

  Raises:
    FileNotFoundError: no trace at `trace`; TypeError: `hlo_text` or a leaf of `params` of the wrong kind.
    ValueError: not HLO text, or outputs that do not match the leaves (the first that differs named).
    ProfileError: no event of the program, or an implausible profile (what the trace held).

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
  flat, _, rows = float_leaves(params, "profile_from_trace", "arrays or jax.ShapeDtypeStructs")
  flat = [flat[i] for i in rows]
  paths = [path_str(p) for p, _ in flat]
  shapes = [tuple(int(d) for d in x.shape) for _, x in flat]
  dtypes = [dtype_name(x.dtype) for _, x in flat]
  outputs = _step_hlo.gradient_outputs(hlo, paths, shapes, dtypes)
  notes = []
  if all(k in hlo.params and _step_hlo.hlo_matches(hlo.instrs[hlo.params[k]].shape, shapes[k], dtypes[k])
         for k in range(len(paths))):
    positions = _step_hlo.forward_positions(hlo, len(paths))
    unread = len(paths) + max((p for p in positions if p is not None), default=0)
    order = sorted(range(len(paths)), key=lambda k: (positions[k] if positions[k] is not None else unread,
                                                     -math.prod(shapes[k]), k))
  else:
    order = list(range(len(paths)))
    notes.append("rows in flatten order (the program's first parameters are not the leaves of params, so "
                 "its forward order could not be read)")
  spec = RowSpec(paths=paths, shapes=shapes, dtypes=dtypes, order=order,
                 layers=[layer_of(layer_path(p), layer_depth) for p, _ in flat])
  try:
    trace_read, an = from_trace(trace, hlo, spec, outputs=outputs)
  except ProfileError as e:
    raise ProfileError(f"profile_from_trace({os.fspath(trace)!r}): {e}.") from None
  note = (f"measured: profile_from_trace of {os.fspath(trace)}: {an.executions} executions "
          f"({LINKED[trace_read.linked.get(hlo.module, 'run_id')]}) on {an.devices} device(s), medians on "
          f"the trace's clock; {an.held}; ops mapped to leaves via the ENTRY ROOT tuple, to layers via "
          f"op_name metadata; rows in the compiled forward's order of first use; update not in the "
          f"program (update_s 0)")
  return as_profile(spec, an.ready_s, an.fwd_layer, 0.0, an.forward_s, an.backward_s, method="measured", model="",
                    device=trace_read.device_name or trace_read.platform, notes="; ".join(notes + [note]))
