"""All-reduce microbenchmark: `measure_network` fits a NetworkModel (alpha, beta) to measured timings.

Public API:
  measure_network(num_devices=None, *, sizes=..., repeats=..., stat='median', ...) -> NetworkModel
  time_allreduce(num_devices=None, *, sizes=..., repeats=..., ...) -> AllreduceTimings
  probe(num_devices=None, ...) -> NetworkModel        (what `prophet-jax probe` runs)
  summary(network, timings=None) -> str               (the short human summary the CLI prints)

How it measures: for each message size, one compiled program issues `1` all-reduce and another issues
`1 + inner` all-reduces chained by their data (so XLA cannot combine them), inside `jax.shard_map`
over a 1-D mesh of the devices. The cost of one all-reduce is the paired difference of the two
programs' wall times divided by `inner`, which cancels dispatch and launch overheads and leaves what
an all-reduce costs *inside* a training step (what the simulator needs). The two programs are timed
alternately, `repeats` times. The machine's scheduler tick (about 4 ms) poisons means, so every size
keeps the **median** and a **low percentile** (default p10); the fitted model uses the median (to
predict median step times) unless `stat='low'` asks for the floor. `NetworkModel.name` says which.

Across processes (`jax.process_count() > 1`, after `jax.distributed.initialize`): the mesh spans every
device of every process, each process feeds its local shard, and rank 0's timings are broadcast so
every process returns the same model.

`overlap` comes from the platform: False on the CPU (an XLA CPU collective blocks the executor), True
on GPUs and TPUs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ._errors import NetworkError
from ._types import NetworkModel

#: 1 KiB .. 64 MiB in powers of 4: the default probe.
DEFAULT_SIZES: tuple[int, ...] = tuple(2**k for k in range(10, 27, 2))
#: A quick probe (for tests and the Monitor's periodic probe).
QUICK_SIZES: tuple[int, ...] = (2**10, 2**14, 2**18, 2**20)
_AXIS = "prophet_probe"


@dataclass(frozen=True, slots=True, kw_only=True)
class AllreduceTimings:
  """Measured cost of one all-reduce per message size.

  Attributes:
    sizes: message sizes in bytes (per worker: the bytes each device contributes).
    median_s: median seconds of one all-reduce at each size.
    low_s: the `percentile`-th percentile (the floor without scheduler hiccups).
    percentile: which percentile `low_s` holds.
    repeats: paired measurements per size.
    workers: devices (ranks) taking part.
    processes: processes taking part.
    platform: 'cpu', 'gpu', 'tpu'.
  """

  sizes: tuple[int, ...]
  median_s: tuple[float, ...]
  low_s: tuple[float, ...]
  percentile: float
  repeats: int
  workers: int
  processes: int
  platform: str

  def fit(self, stat: str = "median") -> NetworkModel:
    """The NetworkModel least-squares-fitted to the median (default) or the low percentile."""
    if stat not in ("median", "low"):
      raise ValueError(f"fit(stat={stat!r}): expected 'median' (to predict median step times) or 'low' "
                       f"(the floor).")
    ys = self.median_s if stat == "median" else self.low_s
    label = "median" if stat == "median" else f"p{self.percentile:g}"
    return NetworkModel.fit(self.sizes, ys, workers=self.workers, overlap=self.platform != "cpu",
                            name=f"probe:{self.platform}x{self.workers}:{label}")


def _check_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
  try:
    out = tuple(int(s) for s in sizes)
  except (TypeError, ValueError) as e:
    raise ValueError(f"measure_network(sizes={sizes!r}): sizes must be integers (bytes).") from e
  bad = [s for s in out if s < 4]
  if bad:
    raise ValueError(f"measure_network(sizes=...): size {bad[0]} is too small; every message must be "
                     f">= 4 bytes (one float32).")
  if len(set(out)) < 2:
    raise ValueError(f"measure_network(sizes={out}): needs at least 2 distinct sizes to fit alpha and beta.")
  return tuple(sorted(set(out)))


def _mesh_devices(num_devices: int | None):
  import jax

  if jax.process_count() > 1:
    devices = jax.devices()
    if num_devices is not None and num_devices != len(devices):
      raise ValueError(f"measure_network(num_devices={num_devices}): across {jax.process_count()} "
                       f"processes the probe uses every device ({len(devices)}); pass None or "
                       f"{len(devices)}.")
  else:
    local = jax.local_devices()
    n = len(local) if num_devices is None else int(num_devices)
    if n > len(local):
      raise NetworkError(f"measure_network(num_devices={n}): only {len(local)} {local[0].platform} "
                         f"device(s) here. On the CPU, set XLA_FLAGS=--xla_force_host_platform_device_"
                         f"count={n} before jax starts, or launch several processes.")
    devices = local[:n]
  if len(devices) < 2:
    raise NetworkError(
        f"measure_network: an all-reduce needs at least 2 devices, got {len(devices)} "
        f"({devices[0].platform}). On the CPU set XLA_FLAGS=--xla_force_host_platform_device_count=8 "
        f"before jax starts, or run under `prophet-jax launch --nproc 2`.")
  return devices


def time_allreduce(num_devices: int | None = None, *, sizes: Sequence[int] = DEFAULT_SIZES,
                   repeats: int = 20, inner: int = 3, percentile: float = 10.0,
                   dtype: str = "float32", max_seconds_per_size: float | None = None
                   ) -> AllreduceTimings:
  """Times one all-reduce (psum) at each message size across the devices (or processes).

  Args:
    num_devices: devices on this host to use (default all); must be None or all of them across
      processes.
    sizes: message sizes in bytes per worker (default 1 KiB .. 64 MiB, powers of 4).
    repeats: paired measurements per size (median and percentile are taken over these).
    inner: extra chained all-reduces in the longer program (the difference is divided by it).
    percentile: the low percentile kept besides the median (e.g. 10 for p10).
    dtype: element type of the messages.
    max_seconds_per_size: stop repeating a size after this long (at least 3 repeats run).

  Returns:
    AllreduceTimings (identical on every process).

  Raises:
    NetworkError: a single device, or more devices requested than exist.
    ValueError: bad sizes, repeats, inner or percentile.
  """
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  sizes = _check_sizes(sizes)
  if isinstance(repeats, bool) or int(repeats) < 3:
    raise ValueError(f"measure_network(repeats={repeats!r}): need at least 3 repeats for a median.")
  if isinstance(inner, bool) or int(inner) < 1:
    raise ValueError(f"measure_network(inner={inner!r}): must be an integer >= 1.")
  if not 0 < float(percentile) < 50:
    raise ValueError(f"measure_network(percentile={percentile!r}): the low percentile must be in (0, 50).")
  devices = _mesh_devices(num_devices)
  p = len(devices)
  mesh = jax.sharding.Mesh(np.asarray(devices), (_AXIS,))
  sharding = NamedSharding(mesh, P(_AXIS))
  itemsz = int(np.dtype(jnp.dtype(dtype)).itemsize)

  def program(k: int):
    def body(x):
      scale = jnp.asarray(1.0 / p, x.dtype)
      def one(_, y):
        return jax.lax.psum(y, _AXIS) * scale
      return jax.lax.fori_loop(0, k, one, x)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(_AXIS), out_specs=P(_AXIS),
                                 check_vma=False))

  short, long_ = program(1), program(1 + int(inner))
  med, low = [], []
  for nbytes in sizes:
    n = max(1, nbytes // itemsz)
    local = np.ones((n * len([d for d in devices if d.process_index == jax.process_index()]),),
                    dtype=jnp.dtype(dtype))
    x = jax.make_array_from_process_local_data(sharding, local, (n * p,))
    for f in (short, long_):  # compile and warm up
      jax.block_until_ready(f(x))
      jax.block_until_ready(f(x))
    diffs, t_start = [], time.perf_counter()
    for r in range(int(repeats)):
      t0 = time.perf_counter()
      jax.block_until_ready(short(x))
      t1 = time.perf_counter()
      jax.block_until_ready(long_(x))
      t2 = time.perf_counter()
      diffs.append(((t2 - t1) - (t1 - t0)) / int(inner))
      if max_seconds_per_size is not None and r >= 2 and time.perf_counter() - t_start > max_seconds_per_size:
        break
    d = np.maximum(np.asarray(diffs), 0.0)
    med.append(float(np.median(d)))
    low.append(float(np.percentile(d, percentile)))
    del x
  if jax.process_count() > 1:  # every process must return the same model: rank 0's numbers
    from jax.experimental import multihost_utils

    both = multihost_utils.broadcast_one_to_all(np.asarray([med, low], dtype=np.float64))
    med, low = [float(v) for v in both[0]], [float(v) for v in both[1]]
  return AllreduceTimings(sizes=tuple(max(1, s // itemsz) * itemsz for s in sizes), median_s=tuple(med),
                          low_s=tuple(low), percentile=float(percentile), repeats=int(repeats),
                          workers=p, processes=jax.process_count(), platform=devices[0].platform)


def measure_network(num_devices: int | None = None, *, sizes: Sequence[int] = DEFAULT_SIZES,
                    repeats: int = 20, inner: int = 3, stat: str = "median", percentile: float = 10.0,
                    dtype: str = "float32", max_seconds_per_size: float | None = None) -> NetworkModel:
  """Measures all-reduce cost against message size and fits alpha and beta.

  Args:
    num_devices: devices on this host (default all of them); across processes, every device.
    sizes: message sizes in bytes per worker (default 1 KiB .. 64 MiB).
    repeats: paired measurements per size.
    inner: extra chained all-reduces in the longer timed program.
    stat: 'median' (default: the model predicts median step times) or 'low' (the `percentile` floor).
    percentile: the low percentile kept besides the median.
    dtype: element type of the messages.
    max_seconds_per_size: cap on the time spent on one size.

  Returns:
    A NetworkModel: `alpha_s` per ring step and `beta_s_per_byte` from a least-squares fit (its RMS
    residual in `fit_residual_s`), `workers` the devices taking part, `overlap` False on the CPU, and
    `name` saying the platform and the statistic fitted, e.g. 'probe:cpux8:median'.

  Raises:
    NetworkError: a single device (an all-reduce needs at least 2).

  Example:
    >>> net = measure_network(8, sizes=(2**10, 2**16), repeats=5)   # doctest: +SKIP
    >>> net.workers, net.overlap                                      # doctest: +SKIP
    (8, False)
  """
  if stat not in ("median", "low"):
    raise ValueError(f"measure_network(stat={stat!r}): expected 'median' or 'low'.")
  t = time_allreduce(num_devices, sizes=sizes, repeats=repeats, inner=inner, percentile=percentile,
                     dtype=dtype, max_seconds_per_size=max_seconds_per_size)
  return t.fit(stat)


def probe(num_devices: int | None = None, *, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 15,
          max_seconds_per_size: float | None = 20.0) -> NetworkModel:
  """What `prophet-jax probe --num-devices D` runs: measure_network with CLI-friendly defaults.

  Under `prophet-jax launch` (jax.distributed initialized) the probe spans every process's devices.
  """
  return measure_network(num_devices, sizes=sizes, repeats=repeats,
                         max_seconds_per_size=max_seconds_per_size)


def summary(network: NetworkModel, timings: AllreduceTimings | None = None) -> str:
  """A short human summary of a probed network (and of its timings, when given)."""
  bw = math.inf if network.beta_s_per_byte == 0 else 1 / network.beta_s_per_byte
  lines = [f"{network.name or 'network'}: {network.workers} workers, alpha {network.alpha_s * 1e6:.2f} us "
           f"per ring step (one all-reduce starts in {network.startup_s * 1e6:.1f} us), beta "
           f"{network.beta_s_per_byte * 1e9:.3f} ns/B ({bw / 1e9:.2f} GB/s per link), overlap "
           f"{network.overlap}"]
  if network.fit_residual_s is not None:
    lines.append(f"  fit residual (RMS) {network.fit_residual_s * 1e6:.1f} us")
  if timings is not None:
    lines.append(f"  {'bytes':>10} {'median us':>10} {'p%g us' % timings.percentile:>10} {'model us':>10}")
    for s, m, lo in zip(timings.sizes, timings.median_s, timings.low_s):
      lines.append(f"  {s:>10} {m * 1e6:>10.1f} {lo * 1e6:>10.1f} {network.allreduce_s(s) * 1e6:>10.1f}")
  else:
    for s in (2**10, 2**20, 2**26):
      lines.append(f"  predicted all-reduce of {s / 2**20:g} MiB: {network.allreduce_s(s) * 1e3:.3f} ms")
  return "\n".join(lines)
