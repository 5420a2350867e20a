"""choose: the choice between steps (plans) measured on the user's machines, against their own step.

Every ratio the simulator reports is a model's; before trusting one, time the steps where they will
run. `choose` does that the way a careful benchmark does it: every step on its own copy of the state,
compiled and warmed up first (not timed), then timed in interleaved rounds (round r runs every step
once, in an order that balances positions and predecessors), each candidate's time divided by the control's *in the same round*,
so drift of the machine between rounds cancels. The statistics and the rule are
`_planning._paired` (pure, tested with an injected clock): the median ratio per candidate, a
distribution-free interval of it, and a candidate wins only when its interval clears `min_gain`.

Several processes (jax.distributed): the processes first agree on the steps' names (in rank 0's
order; every process then runs the same step in the same round, so their collectives pair up), every
process times, the timings are all-gathered and a step's time in a round is the slowest process's;
rank 0 decides and broadcasts its Choice as JSON; every process decides from the same gathered
timings too and checks the fingerprint of rank 0's decision against its own, and the processes agree
on the outcome, so all fail together (LaunchError naming the ranks) when one differs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._planning._paired import DEFAULT_CONFIDENCE, Choice, check_options, decide, interleave
from .._values._checks import check_int
from .._values._errors import LaunchError
from ._agreement import gather_messages

__all__ = ["choose", "Choice"]

CONTROL = "control"  # the control's name in the Choice when it is given as a step function


def _split_steps(steps: Any, control: Any) -> tuple[tuple[str, ...], dict[str, Callable], str]:
  """(names with the control first, name -> step, the control's name), checked."""
  if not isinstance(steps, Mapping):
    raise TypeError(f"choose(steps=...): expected a mapping of names to step functions, e.g. "
                    f"{{'wfbp': step_wfbp, 'bucket': step_bucket}}; got {type(steps).__name__}.")
  if not steps:
    raise ValueError("choose(steps={}): no candidates; pass at least one step to time against the control.")
  for k, f in steps.items():
    if not isinstance(k, str) or not k:
      raise TypeError(f"choose(steps=...): step names must be non-empty strings; got {k!r}.")
    if not callable(f):
      raise TypeError(f"choose(steps=...): steps[{k!r}] is a {type(f).__name__}, not a step function.")
  fns = dict(steps)
  if isinstance(control, str):
    if control not in fns:
      raise ValueError(f"choose(control={control!r}): no step of that name among {sorted(fns)}; pass "
                       f"the control's step function, or the name of one of the steps.")
    if len(fns) < 2:
      raise ValueError(f"choose(control={control!r}): it is the only step; there is no candidate to "
                       f"time against it.")
    name = control
  elif callable(control):
    if CONTROL in fns:
      raise ValueError(f"choose(steps=...): a candidate is named {CONTROL!r}, the name the control step "
                       f"is reported under; rename that candidate (or pass control={CONTROL!r} to make "
                       f"it the control).")
    name = CONTROL
    fns = {CONTROL: control, **fns}
  else:
    raise TypeError(f"choose(control=...): expected the control's step function (the user's own step) "
                    f"or the name of one of the steps; got {type(control).__name__}.")
  names = (name,) + tuple(k for k in fns if k != name)
  return names, fns, name


def _states(state: Any, names: Sequence[str]) -> dict[str, Any]:
  """Per step its starting state: `state` itself for every step, or `state[name]` when `state` is a
  mapping whose keys are exactly the steps' names (states already converted per plan)."""
  if isinstance(state, Mapping) and set(state) & set(names):
    if set(state) != set(names):
      missing = sorted(set(names) - set(state))
      extra = sorted(set(state) - set(names))
      raise ValueError(f"choose(state=...): a mapping of states per step must name exactly the steps "
                       f"{list(names)}; missing {missing}, extra {extra}. (A state that is itself a dict "
                       f"must not use the steps' names as keys.)")
    return {n: state[n] for n in names}
  return {n: state for n in names}


def _copy(tree: Any) -> Any:
  """A copy of every array of `tree` (a donating step consumes its input's buffers; the caller's state
  and the other steps' states must survive it)."""
  return jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, tree)


def _next_state(out: Any, state: Any, name: str) -> Any:
  """The state to feed the next call: `out` when it has the state's structure, else `out[0]` (a step
  returning `(state, loss)` or `(state, metrics)`)."""
  want = jax.tree.structure(state)
  if jax.tree.structure(out) == want:
    return out
  if isinstance(out, tuple) and out and jax.tree.structure(out[0]) == want:
    return out[0]
  raise TypeError(f"choose: step {name!r} returned a {type(out).__name__} of structure "
                  f"{jax.tree.structure(out)}, neither the state's structure {want} nor a tuple whose "
                  f"first element has it; a step must be `state = step(state, batch)` or "
                  f"`state, aux = step(state, batch)`.")


def _agree_names(names: tuple[str, ...]) -> tuple[str, ...]:
  """Every process runs the same steps in the same order: rank 0's, checked on every process."""
  if jax.process_count() == 1:
    return names
  text = "\n".join(names)
  mine = gather_messages(text)
  if any(m != mine[0] for m in mine):
    bad = [r for r, m in enumerate(mine) if m != mine[0]]
    raise LaunchError(f"choose: rank(s) {bad} have other steps than rank 0: {mine[0].splitlines()} on "
                      f"rank 0, {mine[bad[0]].splitlines()} on rank {bad[0]} (names and control must be "
                      f"the same everywhere, in the same order).")
  return names


def _slowest(seconds: np.ndarray) -> np.ndarray:
  """Per (round, step) the largest time over the processes (a step waits for its slowest process)."""
  if jax.process_count() == 1:
    return seconds
  from jax.experimental import multihost_utils  # multi-process only

  every = np.asarray(multihost_utils.process_allgather(seconds.astype(np.float64)))
  return every.reshape((jax.process_count(),) + seconds.shape).max(axis=0)


def _agree_choice(mine: Choice) -> Choice:
  """Rank 0's Choice on every process, its fingerprint checked against each process's own."""
  if jax.process_count() == 1:
    return mine
  from jax.experimental import multihost_utils  # multi-process only

  rank = jax.process_index()
  payload = mine.to_json().encode() if rank == 0 else b""
  n = int(np.asarray(multihost_utils.broadcast_one_to_all(np.asarray([len(payload)], np.int32)))[0])
  buf = np.zeros(n, np.uint8)
  if rank == 0:
    buf[:] = np.frombuffer(payload, np.uint8)
  got = Choice.from_json(bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf)).astype(np.uint8)).decode())
  msg = "" if got.fingerprint == mine.fingerprint else (
      f"rank {rank} decided {mine.best!r} (fingerprint {mine.fingerprint}) from the same timings where "
      f"rank 0 decided {got.best!r} ({got.fingerprint})")
  messages = gather_messages(msg)
  bad = [r for r, m in enumerate(messages) if m]
  if bad:
    raise LaunchError(f"choose: rank {rank}: rank(s) {bad} disagree with rank 0's decision: "
                      f"{messages[bad[0]]}. Check that every process runs the same library versions.")
  return got


def choose(steps: Mapping[str, Callable], state: Any, batches: Sequence[Any], *, control: Any,
           rounds: int | None = None, min_gain: float = 0.02, warmup: int = 2,
           confidence: float = DEFAULT_CONFIDENCE) -> Choice:
  """Times candidate steps against a control on this machine (or these processes) and picks one.

  Every step runs on its own copy of its starting state (the caller's state is never consumed, even
  by a donating step), `warmup` times untimed (compilation included), then once per round for
  `rounds` interleaved rounds, each call waited for (`jax.block_until_ready`). Round r feeds every
  step the same batch, `batches[r % len(batches)]`. A candidate's ratio in a round is its time over
  the control's in that round; `Choice.ratios` holds the median over rounds and `Choice.intervals` a
  distribution-free `confidence` interval of it (order statistics of the rounds' log-ratios). A
  candidate wins only when its interval's upper end is below 1/(1 + min_gain), i.e. the lower end of
  its speed-up beats 1 + min_gain; among several winners, the smallest median ratio. Otherwise the
  control stays, and `Choice.reason` says why.

  With several processes every process must call `choose` with the same step names; all of them time,
  a step's time is the slowest process's, rank 0 decides and every process gets (and checks) the same
  Choice.

  Cost: `rounds` timed calls of every step plus `warmup` each. The default (750 rounds) resolves a 5%
  difference under 10% noise per timing (lognormal): a control and two candidates then cost 2,250
  timed steps; on a quiet machine (1-2% noise) 50-100 rounds do.

  Args:
    steps: name -> step function (a jitted or compiled step), called `step(state, batch)` and
      returning the new state, or a tuple `(state, aux...)`.
    state: the starting state for every step; or, for steps of different plans (whose states differ,
      e.g. a sharded `dear` state), a mapping name -> state naming exactly every step, the control
      included (its name is "control" when `control` is a function): convert the state of the plan
      in use with `prophet_jax.convert_state` for each candidate. States are copied, never consumed.
    batches: a sequence of batches (a list; `[batch]` for one).
    control: the user's own step function (reported as "control"), or the name of one of `steps`.
    rounds: timed rounds (default `DEFAULT_ROUNDS`, 750).
    min_gain: the smallest speed-up that counts (0.02: a candidate must be shown >= 2% faster).
    warmup: untimed calls of every step before the rounds (the first compiles).
    confidence: coverage of each ratio's interval (default 0.95).

  Returns:
    A `Choice`, the same on every process.

  Raises:
    TypeError, ValueError: no candidates, a candidate named like the control, a bad option, a state
      mapping that does not name every step, a step returning something else than its state.
    LaunchError: the processes have different steps, or disagree on the decision.

  Example:
    >>> choice = prophet_jax.choose({"wfbp": step_wfbp, "bucket": step_bucket}, state, [batch],
    ...                             control=step_pmean)                       # doctest: +SKIP
    >>> print(choice.describe())                                               # doctest: +SKIP
  """
  names, fns, control_name = _split_steps(steps, control)
  rounds, min_gain, confidence = check_options("choose", rounds, min_gain, confidence)
  warmup = check_int("choose", "warmup", warmup, lo=1, fix="The first call compiles; it must not be timed.")
  if isinstance(batches, (str, bytes)) or not isinstance(batches, Sequence) or len(batches) == 0:
    raise TypeError(f"choose(batches=...): expected a non-empty sequence of batches (a list; [batch] "
                    f"for one); got {type(batches).__name__}.")
  names = _agree_names(names)
  start = _states(state, names)
  current = {n: _copy(start[n]) for n in names}
  for n in names:
    for w in range(warmup):
      current[n] = _next_state(jax.block_until_ready(fns[n](current[n], batches[w % len(batches)])),
                               start[n], n)

  def measure(name: str, r: int) -> float:
    t0 = time.perf_counter()
    out = jax.block_until_ready(fns[name](current[name], batches[r % len(batches)]))
    dt = time.perf_counter() - t0
    current[name] = _next_state(out, start[name], name)
    return dt

  seconds = _slowest(interleave(names, rounds, measure))
  mine = decide(names, seconds, control=control_name, min_gain=min_gain, confidence=confidence,
                processes=jax.process_count())
  return _agree_choice(mine)
