"""A data-parallel train step of a model, written as a user writes it, lowered and compiled for a
compile-only GPU topology: what `prophet-jax audit`, the GPU tests and `bench/gpu_hlo.py` compile.

`lower_step(model, schedule, mode, topology)` builds `jax.jit(jax.shard_map(step))` over
`topology.mesh(axis_name)` for one of `STEP_MODES` (`scheduled`, `hooked`, `pipelined`, or the plain
`pmean` step) and lowers it on ShapeDtypeStructs; `compile_step` also compiles it (XLA:GPU's whole
pipeline: nothing runs) and says how long that took. `prophet_jax.audit(compiled, schedule)` reads the
result. The topology is `_gpu`'s (`prophet_jax.gpu_topology`); this module sits above the rewrite
(`_transform`, `_pipelined`) it carries out, so importing it imports jax: make the topology first
(`gpu_topology` checks the environment before jax starts).
"""

from __future__ import annotations

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

__all__ = ["STEP_MODES", "lower_step", "compile_step"]

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

  The step is `jax.jit(jax.shard_map(...))` over `topology.mesh(axis_name)`, lowered on
  ShapeDtypeStructs (nothing is allocated or run):
  - 'scheduled': `jax.value_and_grad` of the loss at params marked varying, `prophet_jax.scheduled(tx,
    schedule)` as the optimizer, and the user's `pmean` of the loss;
  - 'hooked': `prophet_jax.hooked(loss_fn, schedule)` gradients, a plain `tx`, the loss `pmean` (a
    sharded schedule's: its reduce-scattered GradShards, `scheduled(tx, schedule)`);
  - 'pipelined': `prophet_jax.pipelined(loss_fn, tx, schedule).step`, with a forward pending (the
    program that runs the previous backward, the all-reduces, the update and the next forward);
  - 'pmean': the plain step, `jax.lax.pmean` of the gradient tree (the baseline XLA merges).
  With a sharded schedule (`dear`) the optimizer state is each device's shard state (ZeRO-1), made
  inside the map and passed with `P(axis_name)`.

  With `jit=True`, the step as plain `jax.jit` users write it, on global arrays (params `P()`, the batch
  `P(axis_name)`) and no `shard_map` of the user's: 'hooked' and 'pipelined' take `mesh=`, 'pmean' is
  `jax.value_and_grad` whose all-reduce the partitioner inserts ('scheduled' needs gradients unreduced
  over the axis, which this harness does not make: use 'hooked').

  Args:
    model: a `prophet_jax.models` TrainableModel, or any object with `abstract_params()`,
      `loss_fn(params, batch)` and `make_batch(rng, batch_size)` (and `default_batch_size` when
      `batch_size` is None).
    schedule: the Schedule to carry out (ignored by 'pmean').
    mode: one of `STEP_MODES`.
    topology: from `gpu_topology`.
    batch_size: global batch (divisible by the device count); default `model.default_batch_size`.
    axis_name: the mesh axis.
    tx: the optimizer (default `optax.sgd(0.1, momentum=0.9)`).
    jit: the plain `jax.jit` step over sharded arrays (above) instead of `jax.jit(jax.shard_map(...))`.
    enforce_order: passed to the rewrite (False: combiner keys in place of the tie).

  Returns:
    The `jax.stages.Lowered` step: `.compile()` it (or `.compile(compiler_options={...})` for
    per-compile XLA options such as `xla_gpu_all_reduce_combine_threshold_bytes`), or use
    `compile_step`.

  Raises:
    ValueError: an unknown mode, 'scheduled' with `jit=True`, or a batch that does not split over the
      devices.
  """
  if mode not in STEP_MODES:
    raise ValueError(f"lower_step(mode={mode!r}): expected one of {list(STEP_MODES)}.")
  if jit and mode == "scheduled":
    raise ValueError("lower_step(mode='scheduled', jit=True): a plain jax.jit step's gradients come "
                     "already reduced by the partitioner; schedule them with mode='hooked' (hooked(..., "
                     "mesh=)), or use jit=False.")
  n = len(topology.devices)
  batch_size = int(batch_size or getattr(model, "default_batch_size", n))
  if batch_size % n:
    raise ValueError(f"lower_step(batch_size={batch_size}): the global batch must split evenly over "
                     f"{n} devices; use a multiple of {n}.")
  tx = optax.sgd(0.1, momentum=0.9) if tx is None else tx
  mesh = topology.mesh(axis_name)
  params = model.abstract_params()
  batch = jax.eval_shape(lambda k: model.make_batch(k, batch_size), jax.random.key(0))
  a_batch = topology.abstract(batch, P(axis_name), mesh=mesh)
  if jit:
    return _lower_jit(model, schedule, mode, topology, mesh, params, a_batch, axis_name, tx, enforce_order)
  keys = {"enforce_order": enforce_order}
  if mode == "pipelined":
    pipe = pipelined(model.loss_fn, tx, schedule, axis_name=axis_name, **keys)
    specs = pipe.state_specs()

    def body(state, b):
      state, loss = pipe.step(state, b)
      return state, loss[None]

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P(axis_name)),
                                 out_specs=(specs, P(axis_name))))
    if schedule.num_reduce_scatters:  # a ZeRO-1 plan's shard state is made inside the map
      init = jax.shard_map(pipe.init, mesh=mesh, in_specs=P(), out_specs=specs)
      state0 = jax.eval_shape(init, topology.abstract(params, P(), mesh=mesh))
      state0 = topology.abstract(state0, pipe.state_specs(state0), mesh=mesh)
    else:
      state0 = topology.abstract(jax.eval_shape(pipe.init, params), P(), mesh=mesh)
    pending, _ = jax.eval_shape(step, state0, a_batch)  # the state after a first, forward-only call
    args = (topology.abstract(pending, pipe.state_specs(pending), mesh=mesh), a_batch)
  else:
    sharded = mode != "pmean" and schedule.num_reduce_scatters > 0
    # a sharded schedule's hooked gradients are reduce-scattered shards that scheduled(tx) consumes
    opt = scheduled(tx, schedule, axis_name=axis_name, **keys) if mode == "scheduled" or (
        sharded and mode == "hooked") else tx
    grad_fn = hooked(model.loss_fn, schedule, axis_name=axis_name, **keys) if mode == "hooked" else None

    def body(p, o, b):
      if grad_fn is not None:
        loss, g = grad_fn(p, b)
      else:
        loss, g = jax.value_and_grad(model.loss_fn)(jax.lax.pcast(p, axis_name, to="varying"), b)
        if mode == "pmean":
          g = jax.lax.pmean(g, axis_name)
      updates, o = opt.update(g, o, p)
      return optax.apply_updates(p, updates), o, jax.lax.pmean(loss, axis_name)

    ospec = P(axis_name) if sharded else P()  # ZeRO-1: each device's shard state, made inside the map
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), ospec, P(axis_name)),
                                 out_specs=(P(), ospec, P())))
    a_params = topology.abstract(params, P(), mesh=mesh)
    if sharded:
      init = jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=ospec)
      a_opt = topology.abstract(jax.eval_shape(init, a_params), ospec, mesh=mesh)
    else:
      a_opt = topology.abstract(jax.eval_shape(opt.init, params), P(), mesh=mesh)
    args = (a_params, a_opt, a_batch)
  return step.lower(*args)


def _lower_jit(model: Any, schedule: Any, mode: str, topology: GpuTopology, mesh: Any, params: Any,
               a_batch: Any, axis_name: str, tx: Any, enforce_order: bool = True) -> Any:
  """`lower_step(..., jit=True)`: the plain `jax.jit` step on global arrays."""
  a_params = topology.abstract(params, P(), mesh=mesh)
  if mode == "pipelined":
    pipe = pipelined(model.loss_fn, tx, schedule, axis_name=axis_name, mesh=mesh, enforce_order=enforce_order)
    state0 = jax.eval_shape(pipe.init, a_params)
    pending, _ = jax.eval_shape(pipe.step, topology.abstract(state0, pipe.state_specs(state0), mesh=mesh),
                                a_batch)  # the state after a first, forward-only call
    return jax.jit(pipe.step).lower(topology.abstract(pending, pipe.state_specs(pending), mesh=mesh), a_batch)
  grad_fn = (hooked(model.loss_fn, schedule, axis_name=axis_name, mesh=mesh, enforce_order=enforce_order)
             if mode == "hooked" else jax.value_and_grad(model.loss_fn))
  # a sharded schedule's hooked gradients are reduce-scattered shards that scheduled(tx, mesh=) consumes
  sharded = mode == "hooked" and schedule.num_reduce_scatters > 0
  opt = scheduled(tx, schedule, axis_name=axis_name, mesh=mesh, enforce_order=enforce_order) if sharded else tx

  def step(p, o, b):
    loss, g = grad_fn(p, b)
    updates, o = opt.update(g, o, p)
    return optax.apply_updates(p, updates), o, loss

  if sharded:  # ZeRO-1: each device's shard state, a global array split over the axis
    o0 = jax.eval_shape(opt.init, a_params)
    a_opt = topology.abstract(o0, state_specs(o0, axis_name), mesh=mesh)
  else:
    a_opt = topology.abstract(jax.eval_shape(tx.init, params), P(), mesh=mesh)
  return jax.jit(step).lower(a_params, a_opt, a_batch)
