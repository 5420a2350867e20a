"""The network probe: all-reduces timed against message size, and their fit (docs/design.md, "The network probe")."""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .._values._checks import check_int, check_number
from .._values._errors import NetworkError
from .._values._network import NetworkModel, fit_warning, fmt_bytes

#: 1 KiB .. 64 MiB in powers of 4: the default probe.
DEFAULT_SIZES: tuple[int, ...] = tuple(2**k for k in range(10, 27, 2))
#: A quick probe (for tests and the Monitor's periodic probe).
QUICK_SIZES: tuple[int, ...] = (2**10, 2**14, 2**18, 2**20)
#: The probe's default time budget in seconds (compiles included): on 8 GPUs of one node the default sizes
#: should fit (about 0.2 s of compiling each).
DEFAULT_BUDGET_S = 6.0
#: The default budget on host CPU devices of one process, where the probe times copies between threads:
#: a stand-in for a network, which a longer probe does not make real (it reaches about 16-64 KiB).
HOST_BUDGET_S = 1.0
_AXIS = "prophet_probe"
#: The compute put before each all-reduce when interleaving: (rows, d) @ (d, d) per device, at two
#: sizes (the second only to measure skew).
_ROWS = 32
_COMPUTE_D = (256, 768)


@dataclass(frozen=True, slots=True, kw_only=True)
class AllreduceTimings:
  """Measured cost of one all-reduce per message size (`probe`).

  Attributes:
    sizes, median_s, low_s: bytes per worker; the median and the `percentile`-th percentile seconds there.
    repeats, workers, processes, platform: paired measurements per size; devices; processes; 'cpu', 'gpu'.
    skew, compute_s: the slowest device's lag per second of compute and the compute put before each
      all-reduce (0 and empty unless interleaved; see NetworkModel).
    time_budget_s, cut_sizes: the probe's budget and the sizes it left unmeasured.
  """

  sizes: tuple[int, ...]
  median_s: tuple[float, ...]
  low_s: tuple[float, ...]
  percentile: float
  repeats: int
  workers: int
  processes: int
  platform: str
  skew: float = 0.0
  compute_s: tuple[float, ...] = ()
  time_budget_s: float | None = None
  cut_sizes: tuple[int, ...] = ()

  def fit(self, stat: str = "median") -> NetworkModel:
    """The NetworkModel least-squares-fitted to the median (default) or the low percentile ('low')."""
    if stat not in ("median", "low"):
      raise ValueError(f"fit(stat={stat!r}): expected 'median' (to predict median step times) or 'low' "
                       f"(the floor).")
    ys, label = (self.median_s, "median") if stat == "median" else (self.low_s, f"p{self.percentile:g}")
    return NetworkModel.fit(self.sizes, ys, workers=self.workers, overlap=self.platform != "cpu",
                            name=f"probe:{self.platform}x{self.workers}:{label}", skew=self.skew,
                            warn=False)  # measure_network and the CLI warn with check_fit

  def describe(self, network: NetworkModel | None = None) -> str:
    """The fitted model (`network`, default `fit()`) and, per size, the times beside its prediction."""
    network = self.fit() if network is None else network
    lines = [line for line in network.describe().splitlines() if not line.lstrip().startswith("predicted all-reduce")]
    lines.append(f"  {'bytes':>10} {'median us':>10} {'p%g us' % self.percentile:>10} {'model us':>10}")
    for s, m, lo in zip(self.sizes, self.median_s, self.low_s):
      lines.append(f"  {s:>10} {m * 1e6:>10.1f} {lo * 1e6:>10.1f} {network.allreduce_s(s) * 1e6:>10.1f}")
    if self.cut_sizes:
      lines.append(f"  not measured (the {self.time_budget_s:g} s time budget): "
                   f"{', '.join(fmt_bytes(s) for s in self.cut_sizes)}")
    return "\n".join(lines)


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
  num_devices = check_int("measure_network", "num_devices", num_devices, none=True,
                          fix="It is the number of devices to measure across (at least 2), or None for all of them.")
  if num_devices is not None and num_devices < 2:
    raise NetworkError(f"measure_network(num_devices={num_devices}): an all-reduce needs at least 2 "
                       f"devices; pass None (every device) or a count >= 2.")

  if jax.process_count() > 1:
    devices = jax.devices()
    if num_devices is not None and num_devices != len(devices):
      raise ValueError(f"measure_network(num_devices={num_devices}): across {jax.process_count()} "
                       f"processes the probe uses every device ({len(devices)}); pass None or "
                       f"{len(devices)}.")
  else:
    local = jax.local_devices()
    n = len(local) if num_devices is None else num_devices
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


def _agree(flag: bool) -> bool:
  """Rank 0's `flag` on every process: a decision taken from a wall clock must be the same everywhere."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag, np.int32)))


def _reporter(progress: bool | Callable[[str], None]) -> Callable[[str], None]:
  if callable(progress):
    return progress
  if progress:
    return lambda line: print(line, file=sys.stderr, flush=True)
  return lambda line: None


def check_fit(network: NetworkModel, timings: AllreduceTimings, stat: str = "median") -> str | None:
  """The warning text `measure_network` gives when the fitted model does not describe the times, else None."""
  ys = timings.median_s if stat == "median" else timings.low_s
  if timings.platform == "cpu" and timings.processes == 1 and np.any(np.asarray(ys, np.float64)):  # no network
    if fit_warning(network, timings.sizes, ys, who="") is None:
      return None
    rel = (network.fit_residual_s or 0.0) / max(float(np.sqrt(np.mean(np.square(ys)))), 1e-12)
    return (f"measure_network: on host CPU devices the probe times copies between threads, a stand-in for a "
            f"network (fit residual {rel:.0%}): fine to try the library; for plans you will run, probe "
            f"your accelerators (or several processes) or use NetworkModel.preset(...).")
  if not np.any(np.asarray(ys, np.float64)):
    return (f"measure_network: every measured all-reduce time is 0 (the paired difference of the "
            f"two timed programs stayed below the timing noise at {timings.repeats} repeats), so the "
            f"fitted alpha and beta mean nothing. Measure with more repeats, a larger `inner`, or "
            f"larger sizes.")
  text = fit_warning(network, timings.sizes, ys, who="measure_network",
                     advice="Re-run on a quieter machine or with more repeats, fit the floor with "
                            "stat='low', or measure only the sizes your schedules send (sizes=...).")
  cut = timings.cut_sizes
  if text is not None and cut:
    text += (f" The {timings.time_budget_s:g} s time budget measured sizes up to {fmt_bytes(timings.sizes[-1])} "
             f"and cut {fmt_bytes(cut[0])}{'..' + fmt_bytes(cut[-1]) if cut[1:] else ''}: pass a larger "
             f"time_budget_s (or None) to measure them.")
  return text


def probe(num_devices: int | None = None, *, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 20,
          inner: int = 3, percentile: float = 10.0, dtype: str = "float32",
          max_seconds_per_size: float | None = None, interleave: bool = False,
          skew: float | None = None, time_budget_s: float | str | None = "auto",
          progress: bool | Callable[[str], None] = False) -> AllreduceTimings:
  """Times one all-reduce (psum) at each message size across the devices (or processes).

  Args:
    num_devices: devices on this host to use (default all); across processes None or all of them.
    sizes: message sizes in bytes per worker (default 1 KiB .. 64 MiB, powers of 4).
    repeats: paired measurements per size; inner: extra chained all-reduces in the longer program.
    percentile: the low percentile kept besides the median; dtype: the messages' element type.
    max_seconds_per_size: stop repeating a size after this long (at least 3 repeats run).
    interleave, skew: a fixed piece of compute before each all-reduce, as in a training step, and the
      known skew (None measures it); off by default (docs/design.md, "The network probe").
    time_budget_s: seconds the probe may take, compiles included ('auto': 6 s, 1 s on host CPU devices of
      one process; None: every size); the sizes cut are in `cut_sizes`.
    progress: True prints a line per size to stderr, a callable receives the lines (rank 0 only).

  Returns:
    AllreduceTimings, the same on every process.

  Raises:
    NetworkError: a single device, or more devices requested than exist.
    ValueError: bad sizes, repeats, inner, percentile, skew or budget.

  Example:
    >>> t = prophet_jax.probe(8, sizes=(2**10, 2**16), repeats=5)     # doctest: +SKIP
    >>> print(t.describe())                                            # doctest: +SKIP
  """
  sizes = _check_sizes(sizes)
  repeats = check_int("measure_network", "repeats", repeats, lo=3, fix="A median needs at least 3.")
  inner = check_int("measure_network", "inner", inner, lo=1)
  percentile = check_number("measure_network", "percentile", percentile, lo=0, hi=50, lo_open=True, hi_open=True,
                            fix="It is the low percentile, e.g. 10.")
  check_number("measure_network", "skew", skew, lo=0, none=True, fix="None measures it.")
  devices = _mesh_devices(num_devices)
  p = len(devices)
  platform = devices[0].platform
  if time_budget_s == "auto":  # on host CPU devices of one process the probe is a stand-in for a network: short
    time_budget_s = HOST_BUDGET_S if platform == "cpu" and jax.process_count() == 1 else DEFAULT_BUDGET_S
  time_budget_s = check_number("measure_network", "time_budget_s", time_budget_s, lo=0, lo_open=True, none=True,
                               fix="Give seconds, e.g. 10, 'auto' or None for no budget.")
  mesh = jax.sharding.Mesh(np.asarray(devices), (_AXIS,))
  sharding = NamedSharding(mesh, P(_AXIS))
  itemsz = int(np.dtype(jnp.dtype(dtype)).itemsize)
  n_local = len([d for d in devices if d.process_index == jax.process_index()])

  def program(k: int, reduce: bool):
    """k rounds of [compute on h (if interleaving), then one psum of x], each waiting for the last."""
    def body(x, h, w):
      scale = jnp.asarray(1.0 / p, x.dtype)
      def one(_, xh):
        x, h = xh
        if interleave:  # compute that waits for the previous all-reduce, and the next waits for it
          h = jnp.tanh(h @ w) + x[0].astype(h.dtype) * 0
          x = x.at[0].add((h[0, 0] * 0).astype(x.dtype))
        if reduce:
          x = jax.lax.psum(x, _AXIS) * scale
        return x, h
      return jax.lax.fori_loop(0, k, one, (x, h))
    spec = P(_AXIS)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=(spec, spec),
                                 check_vma=False))

  def global_array(local: np.ndarray):
    shape = (local.shape[0] // n_local * p, *local.shape[1:])
    return jax.make_array_from_process_local_data(sharding, local, shape)

  def operands(nbytes: int, d: int):
    x = global_array(np.ones((max(1, nbytes // itemsz) * n_local,), dtype=jnp.dtype(dtype)))
    h = global_array(np.full((_ROWS * n_local, d), 0.01, np.float32))
    w = global_array(np.full((d * n_local, d), 0.01, np.float32))
    return x, h, w

  def paired(short, long_, args, budget: float | None) -> np.ndarray:
    """`repeats` paired timings (fewer once `budget` seconds are spent, at least 3); records the set-up
    (compile and warm-up) and one round's wall time of this size in `costs`."""
    t_setup = time.perf_counter()
    for f in (short, long_):  # compile and warm up
      jax.block_until_ready(f(*args))
      jax.block_until_ready(f(*args))
    diffs, rounds_s, t_start = [], [], time.perf_counter()
    for r in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(short(*args))
      t1 = time.perf_counter()
      jax.block_until_ready(long_(*args))
      t2 = time.perf_counter()
      diffs.append(((t2 - t1) - (t1 - t0)) / inner)
      rounds_s.append(t2 - t0)
      if budget is not None and r >= 2 and _agree(time.perf_counter() - t_start > budget):
        break
    costs.append((t_start - t_setup, float(np.median(rounds_s))))
    return np.asarray(diffs)

  def fits(i: int, nbytes: int) -> bool:
    """Whether size i's shortest measurement (set-up and 3 rounds), predicted from the sizes measured
    before it (round time linear in bytes through the last two, never below the last), fits what is
    left of the budget."""
    (setup_a, round_a), (setup_b, round_b) = costs[-2], costs[-1]
    a, b = sizes[i - 2], sizes[i - 1]
    round_s = max(round_b, round_b + (round_b - round_a) / (b - a) * (nbytes - b))
    need = max(setup_a, setup_b) + 5 * round_s  # warm-up: 2 calls of each program; then 3 rounds
    return time.perf_counter() - t_all + need <= time_budget_s

  d_lo = _COMPUTE_D[0] if interleave else 1
  short, long_ = program(1, True), program(1 + inner, True)
  say = _reporter(progress if jax.process_index() == 0 else False)
  say(f"measure_network: timing one all-reduce over {p} {platform} device(s) at up to {len(sizes)} message "
      f"sizes from {fmt_bytes(sizes[0])} to {fmt_bytes(sizes[-1])}"
      f"{'' if time_budget_s is None else f' as fit in {time_budget_s:g} s'}, {repeats} paired repeats each")
  rounds, costs, cut = [], [], ()
  t_all = time.perf_counter()
  for i, nbytes in enumerate(sizes):
    if time_budget_s is not None and i >= 2 and not _agree(fits(i, nbytes)):
      cut = sizes[i:]
      say(f"measure_network: the {time_budget_s:g} s budget leaves no room for {fmt_bytes(nbytes)} "
          f"and up; fitting {i} sizes")
      break
    t_size = time.perf_counter()
    budget = max_seconds_per_size
    if time_budget_s is not None:  # this size's share of what is left: the rest split over 2 sizes at most
      share = (time_budget_s - (t_size - t_all)) / max(1, min(2, len(sizes) - i))
      budget = share if budget is None else min(budget, share)
    rounds.append(paired(short, long_, operands(nbytes, d_lo), budget))
    r = np.maximum(rounds[-1], 0.0)
    say(f"measure_network: size {i + 1}/{len(sizes)} ({fmt_bytes(nbytes)}): median "
        f"{np.median(r) * 1e6:.1f} us, p{percentile:g} {np.percentile(r, percentile) * 1e6:.1f} us "
        f"over {len(r)} repeats ({time.perf_counter() - t_size:.1f} s; {time.perf_counter() - t_all:.1f} s "
        f"so far)")
  measured_skew, compute = 0.0, ()
  if interleave:  # per-round compute (paired like the all-reduces), and the skew
    c_short, c_long = program(1, False), program(1 + inner, False)
    c_lo = float(np.median(paired(c_short, c_long, operands(sizes[0], d_lo), max_seconds_per_size)))
    if skew is None:
      hi = operands(sizes[0], _COMPUTE_D[1])
      c_hi = float(np.median(paired(c_short, c_long, hi, max_seconds_per_size)))
      ar_hi = float(np.median(paired(short, long_, hi, max_seconds_per_size)))
      ar_lo = float(np.median(rounds[0]))
      # a round with compute c costs c + allreduce + skew * c: the slope over two compute sizes
      measured_skew = max(0.0, ((ar_hi - c_hi) - (ar_lo - c_lo)) / (c_hi - c_lo)) if c_hi > c_lo else 0.0
      compute = (c_lo, c_hi)
    else:
      measured_skew, compute = float(skew), (c_lo,)
    rounds = [r - c_lo * (1 + measured_skew) for r in rounds]
  med = [float(np.median(np.maximum(r, 0.0))) for r in rounds]
  low = [float(np.percentile(np.maximum(r, 0.0), percentile)) for r in rounds]
  if jax.process_count() > 1:  # every process must return the same model: rank 0's numbers
    both = multihost_utils.broadcast_one_to_all(np.asarray(med + low + [measured_skew], dtype=np.float64))
    k = len(med)
    med, low, measured_skew = [float(v) for v in both[:k]], [float(v) for v in both[k:2 * k]], float(both[-1])
  return AllreduceTimings(sizes=tuple(max(1, s // itemsz) * itemsz for s in sizes[:len(rounds)]),
                          median_s=tuple(med), low_s=tuple(low), percentile=percentile, repeats=repeats,
                          workers=p, processes=jax.process_count(), platform=platform,
                          skew=float(measured_skew), compute_s=tuple(compute), time_budget_s=time_budget_s,
                          cut_sizes=tuple(cut))


def measure_network(num_devices: int | None = None, *, sizes: Sequence[int] = DEFAULT_SIZES,
                    repeats: int = 20, inner: int = 3, stat: str = "median", percentile: float = 10.0,
                    dtype: str = "float32", max_seconds_per_size: float | None = None,
                    interleave: bool = False, time_budget_s: float | str | None = "auto",
                    progress: bool | Callable[[str], None] = False) -> NetworkModel:
  """Measures all-reduce cost against message size and fits alpha and beta: `probe`, then its fit.

  Args:
    num_devices, sizes, repeats, inner, percentile, dtype, max_seconds_per_size, interleave, time_budget_s,
      progress: as `probe`.
    stat: 'median' (default: the model predicts median step times) or 'low' (the `percentile` floor).

  Returns:
    A NetworkModel fitted by least squares (`fit_residual_s`), `workers` the devices, `overlap` False on
    the CPU, `name` the platform and statistic ('probe:cpux8:median'); a UserWarning when the fit does not
    describe the times (what to do, and the sizes the budget cut).

  Raises:
    NetworkError: a single device (an all-reduce needs at least 2); ValueError: as `probe`, or a bad `stat`.

  Example:
    >>> net = measure_network(8, sizes=(2**10, 2**16), repeats=5)   # doctest: +SKIP
    >>> net.workers, net.overlap                                      # doctest: +SKIP
    (8, False)
  """
  if stat not in ("median", "low"):
    raise ValueError(f"measure_network(stat={stat!r}): expected 'median' or 'low'.")
  t = probe(num_devices, sizes=sizes, repeats=repeats, inner=inner, percentile=percentile, dtype=dtype,
            max_seconds_per_size=max_seconds_per_size, interleave=interleave, time_budget_s=time_budget_s,
            progress=progress)
  net = t.fit(stat)
  text = check_fit(net, t, stat)
  if text is not None:
    warnings.warn(text, UserWarning, stacklevel=2)
  return net
