"""`Monitor`: Prophet's online monitor: probe, refit, re-plan while training (docs/design.md, "The Monitor")."""

from __future__ import annotations

import collections
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from ._agreement import broadcast_schedule
from .._compiled._devices import mesh_workers
from .._values._checks import check_int, check_number, check_values, match_rows
from .._values._network import NetworkModel
from .._planning._paired import Choice
from ..schedulers._plan import plan
from .._measure._probe import QUICK_SIZES, probe
from .._values._schedule import Schedule
from .._planning._simulate import simulate
from .._rewrite._convert_state import convert_state
from .._values._types import GradientProfile


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
  """One re-plan considered at `step`: the predicted iterations of the schedule in use and the candidate on
  the refitted `network`, `gain` = (current_s - candidate_s) / current_s, and whether it `switched`."""

  step: int
  current_s: float
  candidate_s: float
  gain: float
  switched: bool
  network: NetworkModel


def plan_key(schedule: Schedule) -> str:
  """What makes two schedules the same plan: everything but the prediction (`predicted_s`)."""
  return json.dumps({k: v for k, v in schedule.to_dict().items() if k != "predicted_s"}, sort_keys=True)


class Monitor:
  """Online refit and re-plan: Prophet's monitor of the interconnect during training.

  Args:
    profile, network: the GradientProfile plans are made for; the starting NetworkModel.
    policy, cross_step, options: passed to `plan`.
    threshold: switch only when the candidate is predicted faster by more than this fraction.
    probe_every, probe_sizes, probe_repeats: steps between probes (0: only `observe`), their bytes, repeats.
    window: probe rounds pooled for a refit, and step times for the drift check.
    drift: relative change of the median step time that triggers an early probe (one process).
    build_step: `build_step(schedule) -> step function`, cached per schedule (optional).
    probe_fn, num_devices: `probe_fn(sizes) -> seconds per size` in place of the probe; the probe's devices.
    schedule: the schedule to start with (default: planned now).
    confirm: `confirm(current, new) -> Choice`, a measured verdict before a predicted switch.
    mesh, axis_name: a plain `jax.jit` step's mesh and data axis, whose devices the probe spans.

  Raises:
    TypeError, ValueError: bad arguments (named in the message).

  Example:
    >>> monitor = prophet_jax.Monitor(profile, network, build_step=build_step)  # doctest: +SKIP
    >>> schedule = monitor.record_step(seconds)  # a new Schedule when it switched  # doctest: +SKIP
  """

  def __init__(self, profile: GradientProfile, network: NetworkModel, *, policy: Any = "auto",
               cross_step: bool = False, threshold: float = 0.05, probe_every: int = 100,
               probe_sizes: Sequence[int] | None = None, probe_repeats: int = 5, window: int = 4,
               drift: float = 0.25, build_step: Callable[[Schedule], Any] | None = None,
               probe_fn: Callable[[Sequence[int]], Sequence[float]] | None = None,
               num_devices: int | None = None, schedule: Schedule | None = None,
               options: dict[str, Any] | None = None, mesh: Any = None, axis_name: Any = None,
               confirm: Callable[[Schedule, Schedule], Choice] | None = None):
    check_values("Monitor", profile=profile, network=network)
    check_number("Monitor", "threshold", threshold, lo=0, hi=1, hi_open=True, fix="It is a fraction, e.g. 0.05.")
    for name, v, lo in (("probe_every", probe_every, 0), ("probe_repeats", probe_repeats, 3),
                        ("window", window, 1)):
      check_int("Monitor", name, v, lo=lo)
    check_number("Monitor", "drift", drift, lo=0, lo_open=True, fix="It is a fraction, e.g. 0.25.")
    if confirm is not None and not callable(confirm):
      raise TypeError(f"Monitor(confirm=...): expected confirm(current, new) -> Choice (or None), got "
                      f"{type(confirm).__name__}.")
    if network.workers < 2:
      raise ValueError(f"Monitor: the network has workers={network.workers}; there is nothing to "
                       f"all-reduce with one worker.")
    n = mesh_workers(mesh, axis_name, "Monitor")  # the training mesh's data axis (None: no mesh)
    if n is not None and network.workers != n:
      raise ValueError(f"Monitor: the network has workers={network.workers}, but the mesh has {n} "
                       f"devices along {axis_name or mesh.axis_names[0]!r}, the workers of its "
                       f"all-reduces: use network.with_workers({n}).")
    if n is not None and num_devices is None and jax.process_count() == 1:
      num_devices = n  # the probe's devices: the mesh's data axis
    self.profile = profile
    self.network = network
    self.policy = policy
    self.cross_step = bool(cross_step)
    self.threshold = float(threshold)
    self.probe_every = probe_every
    self.probe_sizes = tuple(int(s) for s in (probe_sizes or QUICK_SIZES))
    self.probe_repeats = probe_repeats
    self.window = window
    self.drift = float(drift)
    self.options = dict(options or {})
    self._build_step = build_step
    self._probe_fn = probe_fn
    self._num_devices = num_devices
    self._steps: collections.deque[float] = collections.deque(maxlen=window)
    self._baseline_s: float | None = None
    self._probes: collections.deque[dict[int, float]] = collections.deque(maxlen=window)
    self._cache: dict[str, Any] = {}
    self.steps = 0
    self.decisions: list[Decision] = []
    self._confirm = confirm
    self.confirmations: list[Choice] = []
    self.builds = 0
    if schedule is None:
      schedule = self._plan(network)
    self._check(schedule)  # before the broadcast too: rank 0 fails at once on a foreign schedule
    self.schedule = self._agree(schedule)

  # -- planning ---------------------------------------------------------------------------------------
  def _plan(self, network: NetworkModel) -> Schedule:
    return plan(self.profile, network, self.policy, cross_step=self.cross_step, **self.options)

  def _predict(self, schedule: Schedule, network: NetworkModel) -> float:
    return float(simulate(schedule, self.profile, network, cross_step=self.cross_step).iteration_s)

  def _check(self, schedule: Schedule) -> None:
    match_rows(schedule, self.profile.tree_rows(), where="Monitor", theirs="this process's profile")

  def _agree(self, schedule: Schedule) -> Schedule:
    """Rank 0's schedule on every process (itself in one), checked against this process's profile."""
    got = schedule if jax.process_count() == 1 else broadcast_schedule(schedule)
    self._check(got)
    return got

  @property
  def is_decider(self) -> bool:
    """True on the process whose decisions count (rank 0; the only one in a single process)."""
    return jax.process_index() == 0

  # -- the compiled-step cache ----------------------------------------------------------------------
  @property
  def step_fn(self) -> Any:
    """build_step(schedule) for the schedule in use, built once per distinct schedule."""
    if self._build_step is None:
      raise ValueError("Monitor.step_fn: no build_step was given; pass build_step=lambda schedule: ... "
                       "(e.g. a jitted step using prophet_jax.scheduled(tx, schedule, axis_name=...)).")
    key = plan_key(self.schedule)
    if key not in self._cache:
      self._cache[key] = self._build_step(self.schedule)
      self.builds += 1
    return self._cache[key]

  def convert_state(self, state: Any, params: Any, *, tx: Any = None, mesh: Any = None, axis_name: Any = None,
                    num_devices: int | None = None, every_k: int | None = None) -> Any:
    """`prophet_jax.convert_state(state, params, self.schedule, ...)`: call it after a switch, before the
    new `step_fn` runs (a state already of this schedule comes back as it is)."""
    return convert_state(state, params, self.schedule, tx=tx, mesh=mesh, axis_name=axis_name,
                         num_devices=num_devices, every_k=every_k)

  # -- measurements ---------------------------------------------------------------------------------
  def record_step(self, seconds: float) -> Schedule | None:
    """Records one step's wall time; probes when due. Returns the new schedule if it switched."""
    seconds = float(seconds)
    if not seconds >= 0:
      raise ValueError(f"Monitor.record_step(seconds={seconds!r}): expected a time >= 0.")
    self.steps += 1
    self._steps.append(seconds)
    if self._baseline_s is None and len(self._steps) == self._steps.maxlen:
      self._baseline_s = statistics.median(self._steps)
    due = (self.probe_every > 0 and self.steps % self.probe_every == 0) or self._drifted()
    return self.probe_now() if due else None

  def _drifted(self) -> bool:
    if jax.process_count() > 1 or self._baseline_s is None or len(self._steps) < self._steps.maxlen:
      return False  # several processes would disagree on when to probe: periodic probes only
    base = self._baseline_s
    return base > 0 and abs(statistics.median(self._steps) - base) > self.drift * base

  def probe_now(self) -> Schedule | None:
    """Times a few small all-reduces now, refits and maybe re-plans; the new schedule if switched."""
    sizes = self.probe_sizes
    if self._probe_fn is not None:
      seconds = list(self._probe_fn(sizes))
    else:
      t = probe(self._num_devices, sizes=sizes, repeats=self.probe_repeats, inner=1,
                time_budget_s=None)  # its few quick sizes, all of them, every time
      sizes, seconds = t.sizes, list(t.median_s)
    return self.observe(sizes, seconds)

  def observe(self, sizes: Sequence[int], seconds: Sequence[float]) -> Schedule | None:
    """Adds one round of (bytes, seconds) all-reduce timings, refits, re-plans; new schedule or None."""
    if len(sizes) != len(seconds) or not sizes:
      raise ValueError(f"Monitor.observe: got {len(sizes)} sizes and {len(seconds)} times; they must pair "
                       f"up (and not be empty).")
    self._probes.append({int(s): float(t) for s, t in zip(sizes, seconds)})
    xs = sorted({s for rnd in self._probes for s in rnd})  # every size probed in the window, its median
    ys = [statistics.median([rnd[s] for rnd in self._probes if s in rnd]) for s in xs]
    fit = NetworkModel.fit(xs, ys, workers=self.network.workers, overlap=self.network.overlap,
                           name="monitor", skew=self.network.skew)
    # the refit measures alpha and beta; the starting model's pressure (what the probe cannot see
    # between steps) stays, so the re-plan is for the same shared network
    self.network = fit.replace(links=self.network.links, pressure=self.network.pressure)
    return self.replan()

  def replan(self) -> Schedule | None:
    """Re-plans on the current network model (rank 0 decides); the new schedule if it switched, else None."""
    chosen = self.schedule
    if self.is_decider:
      candidate = self._plan(self.network)
      cur = self._predict(self.schedule, self.network)
      new = self._predict(candidate, self.network)
      gain = (cur - new) / cur if cur > 0 else 0.0
      switch = gain > self.threshold and plan_key(candidate) != plan_key(self.schedule)
      self.decisions.append(Decision(step=self.steps, current_s=cur, candidate_s=new, gain=gain,
                                     switched=switch, network=self.network))
      if switch:
        chosen = candidate
    chosen = self._agree(chosen)
    if plan_key(chosen) == plan_key(self.schedule) or (self._confirm is not None and not self._confirmed(chosen)):
      return None
    self.schedule = chosen
    self._baseline_s = None  # a new plan: a new step-time baseline
    self._steps.clear()
    return chosen

  def _confirmed(self, new: Schedule) -> bool:
    """`confirm(current, new)`'s measured verdict (the same on every process: `choose` decides once)."""
    choice = self._confirm(self.schedule, new)
    if not isinstance(choice, Choice):
      raise TypeError(f"Monitor(confirm=...): confirm(current, new) returned a {type(choice).__name__}; "
                      f"it must return the prophet_jax.Choice of choose(...).")
    self.confirmations.append(choice)
    return choice.switched
