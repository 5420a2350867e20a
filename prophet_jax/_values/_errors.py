"""Errors raised by prophet_jax. Bad arguments raise ValueError/TypeError; domain failures these."""

from __future__ import annotations


class ProphetError(Exception):
  """Base class of every prophet_jax domain error. The CLI prints its message and exits 2."""


class ProfileError(ProphetError, ValueError):
  """A GradientProfile is malformed: a row has a negative or non-finite time, a size that does not
  match its shape and dtype, or the profile is empty. Fix the profile (or the trace it came from)."""


class NetworkError(ProphetError, ValueError):
  """A NetworkModel is malformed (negative alpha or beta, fewer than one worker, an unknown preset or
  algorithm), or a fit of alpha and beta had too little data."""


class ScheduleError(ProphetError, ValueError):
  """A Schedule breaks an invariant: an element of a gradient row is missing or sent twice, a chunk
  mixes dtypes, a slice is out of range, or the stored fingerprint does not match the rows. Plan again
  rather than editing a schedule by hand."""


class ScheduleMismatchError(ProphetError, ValueError):
  """A Schedule was planned for another pytree than the one it is applied to (a path, shape or dtype
  differs). Run prophet_jax.plan() again on the current params."""


class UnboundAxisError(ProphetError, NameError):
  """A collective ran with an axis name that is not bound: call the step inside jax.pmap or
  jax.shard_map with a mesh axis of that name."""


class AlreadyReducedError(ProphetError, ValueError):
  """Gradients reaching the scheduled all-reduce were already summed over the axis (shard_map's
  check_vma makes jax.grad sum replicated parameters' gradients). Mark the parameters varying with
  jax.lax.pcast(params, axis_name, to='varying') before jax.grad, or use check_vma=False."""


class TraceUnavailableError(ProphetError, FileNotFoundError):
  """A bundled or external trace is not available on this machine (e.g. the GoogLeNet public data set,
  which is read from ../shared/traces at run time and is not shipped with the package)."""


class LaunchError(ProphetError, RuntimeError):
  """A multi-process run could not start or lost a process: the coordinator was unreachable within
  the initialization timeout, or the processes disagree about the schedule. Check that rank 0 is
  running and that the coordinator address and port are reachable from every process."""


class GlooBindError(ProphetError, RuntimeError):
  """Gloo (jax's CPU collectives) could not be bound to a network interface: the private jax call that
  does it is missing from this jax, or it came too late (after the backend started, or before
  jax.distributed.initialize). Use a tested jax version, call prophet_jax.launch.initialize() before any
  other jax call, or run without --gloo-interface."""


class CompositionError(ProphetError, ValueError):
  """`scheduled(...)` sits where it cannot give the all-reduced result: after another transformation in
  an `optax.chain` (clipping or normalising per-device gradients before the all-reduce gives another
  result, silently), or inside `optax.MultiSteps` under `shard_map` (the per-device accumulator cannot
  live in a replicated optimizer state). Put `scheduled` outermost: `scheduled(optax.chain(clip, tx))`;
  accumulate with `scheduled(tx, ..., every_k=k)`."""


class GpuCompileError(ProphetError, RuntimeError):
  """A compile-only GPU build (`prophet_jax.gpu_topology`) cannot start here: jax's CUDA plugin or ptxas
  is missing (install a `gpu-compile` extra: pip install 'prophet-jax[gpu-compile]' for CUDA 12,
  'prophet-jax[gpu-compile-cuda13]' for CUDA 13), the plugin's version differs from jaxlib's, the
  plugin's CUDA cannot compile for the target (CUDA 13 dropped the V100), or the process did not set
  JAX_PLATFORMS=cpu."""


class JaxVersionError(ProphetError, RuntimeError):
  """The installed jax lacks a name prophet_jax needs: one of the private JAX names it reads
  (`prophet_jax._compiled._jaxcompat.PRIVATE_JAX`) or the `jax.extend.core` jaxpr API the pipelined step's
  residual analysis reads. The message names it; install a jax prophet_jax was tested with
  (`_jaxcompat.TESTED_JAX_VERSIONS`)."""


class ShardingError(ProphetError, ValueError):
  """The optimizer cannot run on ZeRO-1 shards: under a sharded schedule (`dear`), `scheduled(tx, ...)`
  runs `tx` on each device's flat shards of the chunks, and this `tx` needs whole leaves or the params'
  tree (per-leaf norms, masks, matrix-shaped updates). Use an all-reduce schedule for it."""


class DeferralWarning(UserWarning):
  """`plan(..., "dlcp", max_defer=f)` with f > 0 under a network where communication is exposed found no
  deferral that shortens the predicted iteration, and returned auto's lossless plan. The schedule's
  `decision` option (printed by `Schedule.describe()`) says why and from which `max_defer` deferral
  would pay. Silence it with `warnings.filterwarnings("ignore", category=prophet_jax.DeferralWarning)`."""
