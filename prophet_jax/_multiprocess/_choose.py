"""`choose`: candidate steps timed against the user's own step where they will run (docs/choose.md)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Mapping, Sequence, Set
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._planning._paired import DEFAULT_CONFIDENCE, Choice, check_options, decide, interleave
from .._values._checks import check_int
from .._values._errors import LaunchError
from ._agreement import broadcast_text, failed_ranks, gather_messages
from ._compare import Snapshot, difference, host, loss_of, snapshot

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
      raise ValueError(f"choose(control={control!r}): it is the only step; there is no candidate to time against it.")
    name = control
  elif callable(control):
    if CONTROL in fns:
      raise ValueError(f"choose(steps=...): a candidate is named {CONTROL!r}, the name the control step is reported "
                       f"under; rename that candidate (or pass control={CONTROL!r} to make it the control).")
    name = CONTROL
    fns = {CONTROL: control, **fns}
  else:
    raise TypeError(f"choose(control=...): expected the control's step function (the user's own step) "
                    f"or the name of one of the steps; got {type(control).__name__}.")
  return (name,) + tuple(k for k in fns if k != name), fns, name


def _states(state: Any, names: Sequence[str]) -> dict[str, Any]:
  """Per step its starting state: `state`, or `state[name]` where `state` maps the steps' names."""
  if isinstance(state, Mapping) and set(state) & set(names):
    if set(state) != set(names):
      raise ValueError(f"choose(state=...): a mapping of states per step must name exactly the steps "
                       f"{list(names)}; missing {sorted(set(names) - set(state))}, extra "
                       f"{sorted(set(state) - set(names))}. (A state that is itself a dict "
                       f"must not use the steps' names as keys.)")
    return {n: state[n] for n in names}
  return {n: state for n in names}


def _next_state(out: Any, state: Any, name: str) -> Any:
  """The state to feed the next call: `out` where it has the state's structure, else `out[0]`."""
  want = jax.tree.structure(state)
  if jax.tree.structure(out) == want:
    return out
  if isinstance(out, tuple) and out and jax.tree.structure(out[0]) == want:
    return out[0]
  raise TypeError(f"choose: step {name!r} returned a {type(out).__name__} of structure {jax.tree.structure(out)}, "
                  f"neither the state's structure {want} nor a tuple whose first element has it; a step must be "
                  "`state = step(state, batch)` or `state, aux = step(state, batch)`.")


def _agree_names(names: tuple[str, ...]) -> None:
  """Every process runs the same steps in the same order: LaunchError where a rank's differ from rank 0's."""
  mine = gather_messages("\n".join(names)) if jax.process_count() > 1 else [""]
  bad = [r for r, m in enumerate(mine) if m != mine[0]]
  if bad:
    raise LaunchError(f"choose: rank(s) {bad} have other steps than rank 0: {mine[0].splitlines()} on "
                      f"rank 0, {mine[bad[0]].splitlines()} on rank {bad[0]} (names and control must be "
                      f"the same everywhere, in the same order).")


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
  got = Choice.from_json(broadcast_text(mine.to_json()))
  rank = jax.process_index()
  bad, first = failed_ranks("" if got.fingerprint == mine.fingerprint else (
      f"rank {rank} decided {mine.best!r} (fingerprint {mine.fingerprint}) from the same timings where "
      f"rank 0 decided {got.best!r} ({got.fingerprint})"))
  if bad:
    raise LaunchError(f"choose: rank {rank}: rank(s) {bad} disagree with rank 0's decision: "
                      f"{first}. Check that every process runs the same library versions.")
  return got


def _check_finite(name: str, loss: Any, when: str) -> None:
  """ValueError when a step's loss is NaN or infinite: its time would be compared for nothing."""
  if loss is None:
    return
  value = host(loss).ravel()
  bad = value[~np.isfinite(value)]
  if bad.size:
    raise ValueError(f"choose: step {name!r} returned a non-finite loss ({bad[0]}) {when}; choose times only steps "
                     "that train. Check that batch and the step (a diverging learning rate?), or leave the step out.")


def _lossy(lossy: Any, names: tuple[str, ...], control: str) -> frozenset[str]:
  """The candidates whose difference from the control is reported, not failed, checked."""
  if isinstance(lossy, str) or not isinstance(lossy, (Sequence, Set)):
    raise TypeError(f"choose(lossy={lossy!r}): expected a collection of candidate names, e.g. lossy={{'dlcp'}}.")
  unknown = sorted(set(lossy) - (set(names) - {control}))
  if unknown:
    raise ValueError(f"choose(lossy={sorted(lossy)}): {unknown} are not candidates; the candidates are "
                     f"{sorted(set(names) - {control})}.")
  return frozenset(lossy)


def _compared(names: tuple[str, ...], control: str, seen: dict[str, list[Snapshot]], before: Snapshot,
              lossy: frozenset[str], states: dict[str, Any]) -> dict[str, str]:
  """Per candidate 'equal', 'differs' (lossy) or 'not compared'; ValueError for a lossless one that differs."""
  first, ref = seen[control]
  out = {}
  for n in names[1:]:
    try:
      d = difference(seen[n][1], ref, first, before)
    except ValueError as e:
      raise ValueError(f"choose: step {n!r} cannot be compared with the control {control!r}: {e}. Steps "
                       f"timed against each other must train the same model on the same batches.") from None
    if d is None:
      out[n] = (f"not compared: it returns no loss and choose finds no parameters in its state (a "
                f"{type(states[n]).__name__}); pass compare=lambda state: <its parameters>")
    elif d[0] <= 1:
      out[n] = f"equal: within docs/design.md's tolerance ({d[1]} at {d[0]:.2g} of it)"
    elif n in lossy:
      out[n] = f"differs (lossy, reported): {d[1]} at {d[0]:.3g} times docs/design.md's tolerance"
    else:
      raise ValueError(
          f"choose: step {n!r} computes something else than the control {control!r}: after the second call on the same "
          f"batches, {d[1]} differs by {d[0]:.3g} times docs/design.md's tolerance (1e-3 of the control's update). A "
          "step that does not train, another model, optimizer or learning rate, or gradients of another scale (a psum "
          "for a pmean) would do that: fix the step. If its plan defers gradients on purpose (dlcp, max_defer > 0), "
          f"pass lossy={{{n!r}}} to have the difference reported instead.")
  return out


def choose(steps: Mapping[str, Callable], state: Any, batches: Sequence[Any], *, control: Any,
           rounds: int | None = None, min_gain: float = 0.02, warmup: int = 2,
           confidence: float = DEFAULT_CONFIDENCE, lossy: Collection[str] = (),
           compare: Callable[[Any], Any] | None = None) -> Choice:
  """Times candidate steps against a control on this machine (or these processes) and picks one.

  Each step runs from its own copy of its state, `warmup` times untimed (after the second call each
  candidate's result is compared with the control's), then in `rounds` interleaved rounds (docs/choose.md).

  Args:
    steps: name -> `step(state, batch)`, returning the state or `(state, loss)` / `(state, metrics)`.
    state: the starting state of every step, or name -> state naming every step, the control included.
    batches: a sequence of batches; round r uses `batches[r % len(batches)]`.
    control: the user's own step function (reported as "control"), or the name of one of `steps`.
    rounds, warmup: timed rounds (default 750); untimed calls of every step first (at least 2).
    min_gain, confidence: the smallest speed-up that counts (0.02: 2%); the coverage of each ratio's interval.
    lossy: candidates whose difference from the control is reported, never failed (a deferring plan).
    compare: `compare(state)` -> the values to compare, for states whose parameters choose cannot find.

  Returns:
    A `Choice`, the same on every process.

  Raises:
    TypeError, ValueError: bad arguments, a step returning another structure than its state, a
      non-finite loss, or a candidate (not `lossy`) computing something else than the control.
    LaunchError: the processes have different steps, or disagree on the decision.

  Example:
    >>> choice = prophet_jax.choose({"wfbp": step_wfbp}, state, [batch], control=step)  # doctest: +SKIP
  """
  names, fns, control_name = _split_steps(steps, control)
  rounds, min_gain, confidence = check_options("choose", rounds, min_gain, confidence)
  warmup = check_int("choose", "warmup", warmup, lo=2, fix="The first call compiles and the second is "
                     "compared with the control's.")
  lossy = _lossy(lossy, names, control_name)
  if compare is not None and not callable(compare):
    raise TypeError(f"choose(compare={compare!r}): expected a function state -> the values to compare "
                    f"(e.g. lambda state: state.params), or None.")
  if isinstance(batches, (str, bytes)) or not isinstance(batches, Sequence) or len(batches) == 0:
    raise TypeError(f"choose(batches=...): expected a non-empty sequence of batches (a list; [batch] "
                    f"for one); got {type(batches).__name__}.")
  _agree_names(names)
  start = _states(state, names)
  before = snapshot(start[control_name], None, compare)
  # a copy of every array of each state, which a donating step may consume
  current = {n: jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, start[n]) for n in names}

  def call(n: str, k: int, when: str) -> tuple[float, Any]:
    """Step `n` on batches[k] from its current state, waited for: (its seconds, its loss or None), checked; an
    exception raised in the step leaves with a note naming the step and the call."""
    t0 = time.perf_counter()
    try:
      out = jax.block_until_ready(fns[n](current[n], batches[k % len(batches)]))
    except Exception as e:  # noqa: BLE001 - re-raised as it is, with the candidate named
      e.add_note(f"choose: raised by step {n!r}, {when}, from the state given for it. A step of another plan needs "
                 f"its own state: pass state={{'control': state, {n!r}: prophet_jax.convert_state(state, params, "
                 f"its_schedule, tx=...)}} (docs/choose.md).")
      raise
    dt = time.perf_counter() - t0
    current[n] = _next_state(out, start[n], n)
    loss = loss_of(out, current[n] is out)
    _check_finite(n, loss, when)
    return dt, loss

  seen: dict[str, list[Snapshot]] = {}
  for n in names:
    for w in range(warmup):
      _, loss = call(n, w, f"on its call {w + 1} (warm-up, batches[{w % len(batches)}])")
      if w < 2:
        seen.setdefault(n, []).append(snapshot(current[n], loss, compare))
  compared = _compared(names, control_name, seen, before, lossy, start)
  seconds = _slowest(interleave(names, rounds,
                                lambda n, r: call(n, r, f"in timed round {r} (batches[{r % len(batches)}])")[0]))
  mine = decide(names, seconds, control=control_name, min_gain=min_gain, confidence=confidence,
                processes=jax.process_count())
  said = "; ".join(f"{k!r} {v}" for k, v in compared.items())
  mine = dataclasses.replace(mine, compared=compared,
                             reason=f"{mine.reason} What they compute, after the second call: {said}.")
  return _agree_choice(mine)
