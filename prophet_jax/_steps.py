"""A model's data-parallel train step, written as a user writes it, lowered and compiled for a compile-only GPU
topology (docs/design.md, `lower_step`); importing it imports jax."""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from typing import Any

import jax
import optax
from jax.sharding import PartitionSpec as P

from ._compiled._gpu import GpuTopology
from ._rewrite._pipelined import pipelined
from ._rewrite._hooked import hooked
from ._rewrite._transform import scheduled
from ._rewrite._states import state_specs

STEP_MODES = ("scheduled", "hooked", "pipelined", "pmean")


def compile_step(model: Any, schedule: Any, mode: str, topology: GpuTopology, *,
                 batch_size: int | None = None, axis_name: str = "data", tx: Any = None,
                 compiler_options: Mapping[str, Any] | None = None, jit: bool = False,
                 enforce_order: bool = True) -> tuple[Any, float]:
  """Compiles one data-parallel train step of `model` for `topology`, the way a user writes it.

  `lower_step(...)`, then `.compile(compiler_options=...)`; see `lower_step` for the step of each mode
  and its arguments. Nothing runs (the devices of a compile-only topology cannot execute).

  Args:
    compiler_options: per-compile XLA options (e.g. `{"xla_gpu_all_reduce_combine_threshold_bytes":
      0}`), or None for XLA's defaults.

  Returns:
    (the compiled step, for `prophet_jax.audit`; the seconds `compile()` took).

  Example:
    >>> topo = prophet_jax.gpu_topology("h100", devices=8)
    >>> compiled, seconds = prophet_jax.compile_step(get_model("cnn"), schedule, "hooked", topo)
    >>> print(prophet_jax.audit(compiled, schedule).describe())
  """
  lowered = lower_step(model, schedule, mode, topology, batch_size=batch_size, axis_name=axis_name,
                       tx=tx, jit=jit, enforce_order=enforce_order)
  t0 = time.perf_counter()
  compiled = lowered.compile(compiler_options=dict(compiler_options)) if compiler_options \
      else lowered.compile()
  return compiled, time.perf_counter() - t0


def lower_step(model: Any, schedule: Any, mode: str, topology: GpuTopology, *,
               batch_size: int | None = None, axis_name: str = "data", tx: Any = None,
               jit: bool = False, enforce_order: bool = True) -> Any:
  """Lowers one data-parallel train step of `model` for `topology`, the way a user writes it.

  `jax.jit(jax.shard_map(step))` over `topology.mesh(axis_name)` (with `jit=True` the plain `jax.jit` step on
  global arrays), lowered on ShapeDtypeStructs: nothing is allocated or run. docs/design.md says what each
  of `STEP_MODES` runs.

  Args:
    model: a `prophet_jax.models` TrainableModel, or anything with `abstract_params()`, `loss_fn(params,
      batch)`, `make_batch(rng, batch_size)` (and `default_batch_size`).
    schedule: the Schedule to carry out (ignored by 'pmean').
    mode: one of `STEP_MODES`: 'scheduled', 'hooked', 'pipelined' or 'pmean' (the plain step).
    topology: from `gpu_topology`.
    batch_size: global batch (divisible by the device count); default `model.default_batch_size`.
    axis_name, tx: the mesh axis; the optimizer (default `optax.sgd(0.1, momentum=0.9)`).
    jit: the plain `jax.jit` step over sharded arrays instead of `jax.jit(jax.shard_map(...))`.
    enforce_order: passed to the rewrite (False: combiner keys in place of the tie).

  Returns:
    The `jax.stages.Lowered` step: `.compile()` it, or use `compile_step`.

  Raises:
    ValueError: an unknown mode, 'scheduled' with `jit=True`, or a batch that does not split over the
      devices.

  Example:
    >>> lowered = prophet_jax.lower_step(get_model("cnn"), schedule, "hooked", topo)  # doctest: +SKIP
  """
  if mode not in STEP_MODES:
    raise ValueError(f"lower_step(mode={mode!r}): expected one of {list(STEP_MODES)}.")
  if jit and mode == "scheduled":
    raise ValueError("lower_step(mode='scheduled', jit=True): a plain jax.jit step's gradients come already reduced by "
                     "the partitioner; schedule them with mode='hooked' (hooked(..., mesh=)), or use jit=False.")
  n = len(topology.devices)
  batch_size = int(batch_size or getattr(model, "default_batch_size", n))
  if batch_size % n:
    raise ValueError(f"lower_step(batch_size={batch_size}): the global batch must split evenly over "
                     f"{n} devices; use a multiple of {n}.")
  tx = optax.sgd(0.1, momentum=0.9) if tx is None else tx
  mesh = topology.mesh(axis_name)
  abstract = functools.partial(topology.abstract, mesh=mesh)
  params = model.abstract_params()
  a_params = abstract(params, P())
  a_batch = abstract(jax.eval_shape(lambda k: model.make_batch(k, batch_size), jax.random.key(0)), P(axis_name))
  # the rewrite's arguments: with jit=True the front-ends place the step on the mesh themselves
  kw = {"axis_name": axis_name, "enforce_order": enforce_order, **({"mesh": mesh} if jit else {})}
  if mode == "pipelined":
    pipe = pipelined(model.loss_fn, tx, schedule, **kw)
    if jit:
      step = jax.jit(pipe.step)
      state0 = jax.eval_shape(pipe.init, a_params)
    else:
      specs = pipe.state_specs()

      def body(state, b):
        state, loss = pipe.step(state, b)
        return state, loss[None]

      step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P(axis_name)),
                                   out_specs=(specs, P(axis_name))))
      # a ZeRO-1 plan's shard state is made inside the map
      init = (jax.shard_map(pipe.init, mesh=mesh, in_specs=P(), out_specs=specs) if schedule.num_reduce_scatters
              else pipe.init)
      state0 = jax.eval_shape(init, a_params)
    # the state after a first, forward-only call
    pending, _ = jax.eval_shape(step, abstract(state0, pipe.state_specs(state0)), a_batch)
    return step.lower(abstract(pending, pipe.state_specs(pending)), a_batch)
  # ZeRO-1: each device's shard of the optimizer state; a sharded schedule's hooked gradients are the
  # reduce-scattered shards that scheduled(tx) consumes
  sharded = mode != "pmean" and schedule.num_reduce_scatters > 0
  opt = scheduled(tx, schedule, **kw) if mode == "scheduled" or (sharded and mode == "hooked") else tx
  if mode == "hooked":
    grad_fn = hooked(model.loss_fn, schedule, **kw)
  elif jit:  # 'pmean' on global arrays: the partitioner inserts the all-reduce
    grad_fn = jax.value_and_grad(model.loss_fn)
  else:
    def grad_fn(p, b):  # the user's gradient of varying params ('scheduled'), and its pmean ('pmean')
      loss, g = jax.value_and_grad(model.loss_fn)(jax.lax.pcast(p, axis_name, to="varying"), b)
      return loss, jax.lax.pmean(g, axis_name) if mode == "pmean" else g

  def step(p, o, b):
    loss, g = grad_fn(p, b)
    updates, o = opt.update(g, o, p)
    return optax.apply_updates(p, updates), o, loss if jit else jax.lax.pmean(loss, axis_name)

  step.__name__ = "step" if jit else "body"  # the program's name, in its HLO and the audit's op names

  if not sharded:
    a_opt = abstract(jax.eval_shape(opt.init, params), P())
  elif jit:  # a global array split over the axis
    o0 = jax.eval_shape(opt.init, a_params)
    a_opt = abstract(o0, state_specs(o0, axis_name))
  else:  # made inside the map
    init = jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=P(axis_name))
    a_opt = abstract(jax.eval_shape(init, a_params), P(axis_name))
  if not jit:
    ospec = P(axis_name) if sharded else P()
    step = jax.shard_map(step, mesh=mesh, in_specs=(P(), ospec, P(axis_name)), out_specs=(P(), ospec, P()))
  return jax.jit(step).lower(a_params, a_opt, a_batch)
