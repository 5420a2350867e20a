"""Paired, interleaved timing of steps against a control, and the decision it supports: the statistics of
`choose`, pure numpy (docs/choose.md, "The statistics and the rule").
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._values._checks import check_int, check_number

DEFAULT_ROUNDS = 750
DEFAULT_CONFIDENCE = 0.95
VERDICTS = ("faster", "no difference", "slower")
SCHEMA = 1


def _williams_row(n: int, k: int) -> list[int]:
  """Row k of a Williams design on n treatments (n rows for even n, 2n for odd): a Latin square in which
  every treatment follows every other equally often.
  """
  base = [0] + [(i + 1) // 2 if i % 2 else n - i // 2 for i in range(1, n)]
  return [(b + k) % n for b in base] if k < n else [(b + k - n) % n for b in base][::-1]


def _shuffled(m: int, seed: int) -> list[int]:
  """A permutation of range(m) from splitmix64 and Fisher-Yates: the same on every process and version."""
  state = (seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & (2**64 - 1)
  out = list(range(m))
  for i in range(m - 1, 0, -1):
    state = (state + 0x9E3779B97F4A7C15) & (2**64 - 1)
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    j = (z ^ (z >> 31)) % (i + 1)
    out[i], out[j] = out[j], out[i]
  return out


def round_order(names: Sequence[str], r: int) -> tuple[str, ...]:
  """The order in which round `r` times the steps: a row of a Williams design over `names`, the rows of
  each block of rounds shuffled (fixed seed; docs/choose.md, "What runs").
  """
  n = len(names)
  period = n if n % 2 == 0 else 2 * n
  return tuple(names[i] for i in _williams_row(n, _shuffled(period, r // period)[r % period]))


def interleave(names: Sequence[str], rounds: int, measure: Callable[[str, int], float]) -> np.ndarray:
  """Times every step once per round, interleaved; `measure(name, round) -> seconds`.

  Returns:
    float64 array of shape (rounds, len(names)); column i is names[i].
  """
  col = {n: i for i, n in enumerate(names)}
  out = np.empty((rounds, len(names)), np.float64)
  for r in range(rounds):
    for name in round_order(names, r):
      out[r, col[name]] = float(measure(name, r))
  return out


@functools.lru_cache(maxsize=64)
def _coverage_index(n: int, confidence: float) -> int:
  """The largest j >= 1 with 1 - 2 P(Bin(n, 1/2) <= j-1) >= confidence, or 0 when none exists."""
  alpha = (1.0 - confidence) / 2.0
  total = 2 ** n
  cum = 0  # sum_{i < j} C(n, i), exact integers
  j = 0
  for i in range(n // 2 + 1):
    cum += math.comb(n, i)
    if cum / total > alpha:
      break
    j = i + 1
  return j


def min_rounds(confidence: float = DEFAULT_CONFIDENCE) -> int:
  """The fewest rounds for which the order-statistic interval exists at `confidence` (6 at 0.95)."""
  n = 1
  while _coverage_index(n, confidence) == 0:
    n += 1
  return n


def median_interval(values: Sequence[float], confidence: float = DEFAULT_CONFIDENCE) -> tuple[float, float, float]:
  """(median, lower, upper): the sample median and the order-statistic interval of the median.

  Example:
    >>> m, lo, hi = median_interval([0.1, -0.2, 0.05, 0.0, 0.3, -0.1, 0.2, 0.15], 0.9)
    >>> round(m, 3), lo, hi
    (0.075, -0.1, 0.2)
  """
  x = np.sort(np.asarray(values, np.float64))
  n = x.size
  j = _coverage_index(n, confidence)
  if j == 0:
    raise ValueError(f"median_interval: {n} values cannot give a {confidence:.0%} interval of the median; "
                     f"at least {min_rounds(confidence)} are needed.")
  return float(np.median(x)), float(x[j - 1]), float(x[n - j])


@dataclass(frozen=True, slots=True, kw_only=True)
class Choice:
  """The outcome of `choose`: which step to train with, measured against the control.

  Attributes:
    best: the winning candidate's name, or `control` when none beat it by `min_gain`.
    control: the control's name ("control" when given as a step function).
    ratios: per candidate, the median over rounds of its time / the control's in the same round.
    intervals: per candidate, the (lower, upper) confidence interval of that median ratio.
    verdicts: per candidate, "faster", "slower" or "no difference".
    reason: one sentence: why `best` is best.
    median_s: per step, its median step time in seconds (the slowest process's).
    rounds, min_gain, confidence, processes: what it was measured with.
    compared: per candidate, what it computes against the control after the second call: 'equal',
      'differs' (a lossy plan: reported, not failed) or 'not compared' (`choose`; empty from `decide`).
  """

  best: str
  control: str
  ratios: dict[str, float]
  intervals: dict[str, tuple[float, float]]
  verdicts: dict[str, str]
  reason: str
  median_s: dict[str, float] = field(default_factory=dict)
  rounds: int = 0
  min_gain: float = 0.02
  confidence: float = DEFAULT_CONFIDENCE
  processes: int = 1
  compared: dict[str, str] = field(default_factory=dict)

  __hash__ = None  # type: ignore[assignment]  # holds dicts

  def __post_init__(self) -> None:
    names = set(self.ratios)
    if set(self.intervals) != names or set(self.verdicts) != names:
      raise ValueError(f"Choice: ratios, intervals and verdicts must name the same candidates; got "
                       f"{sorted(self.ratios)}, {sorted(self.intervals)}, {sorted(self.verdicts)}.")
    if self.best != self.control and self.best not in names:
      raise ValueError(f"Choice(best={self.best!r}): neither the control {self.control!r} nor a candidate "
                       f"({sorted(names)}).")
    bad = {k: v for k, v in self.verdicts.items() if v not in VERDICTS}
    if bad:
      raise ValueError(f"Choice: unknown verdicts {bad}; expected one of {VERDICTS}.")

  @property
  def switched(self) -> bool:
    """True when a candidate won (`best` is not the control)."""
    return self.best != self.control

  def to_dict(self) -> dict[str, Any]:
    return {"schema": SCHEMA, "best": self.best, "control": self.control,
            "ratios": dict(self.ratios), "intervals": {k: list(v) for k, v in self.intervals.items()},
            "verdicts": dict(self.verdicts), "reason": self.reason, "median_s": dict(self.median_s),
            "rounds": self.rounds, "min_gain": self.min_gain, "confidence": self.confidence,
            "processes": self.processes, "compared": dict(self.compared)}

  def to_json(self) -> str:
    """JSON text; `Choice.from_json` reads it back equal."""
    return json.dumps(self.to_dict(), indent=1, sort_keys=True)

  @classmethod
  def from_json(cls, text: str) -> Choice:
    d = json.loads(text)
    if d.get("schema") != SCHEMA:
      raise ValueError(f"Choice.from_json: schema {d.get('schema')!r}, expected {SCHEMA}.")
    return cls(best=d["best"], control=d["control"], ratios={k: float(v) for k, v in d["ratios"].items()},
               intervals={k: (float(v[0]), float(v[1])) for k, v in d["intervals"].items()},
               verdicts=dict(d["verdicts"]), reason=d["reason"],
               median_s={k: float(v) for k, v in d["median_s"].items()}, rounds=int(d["rounds"]),
               min_gain=float(d["min_gain"]), confidence=float(d["confidence"]),
               processes=int(d["processes"]), compared=dict(d.get("compared", {})))

  @property
  def fingerprint(self) -> str:
    """sha256 of the canonical JSON: equal on every process that decided the same."""
    return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]

  def describe(self) -> str:
    """A small table: each step's median time, ratio, interval and verdict; then the reason."""
    lines = [f"{'step':<16} {'median ms':>10} {'ratio':>7}  {int(self.confidence * 100)}% interval    verdict"]
    if self.control in self.median_s:
      lines.append(f"{self.control:<16} {self.median_s[self.control] * 1e3:>10.3f} {1.0:>7.3f}  "
                   f"{'':<16} control")
    for k, v in self.ratios.items():
      lo, hi = self.intervals[k]
      ms = f"{self.median_s[k] * 1e3:>10.3f}" if k in self.median_s else f"{'':>10}"
      lines.append(f"{k:<16} {ms} {v:>7.3f}  [{lo:.3f}, {hi:.3f}]   {self.verdicts[k]}")
    return "\n".join(lines + [self.reason])


def check_options(where: str, rounds: Any, min_gain: Any, confidence: Any) -> tuple[int, float, float]:
  """The options of `choose`/`decide`, checked; rounds None -> DEFAULT_ROUNDS."""
  confidence = check_number(where, "confidence", confidence, lo=0.5, hi=1, hi_open=True,
                            fix="It is the interval's coverage, e.g. 0.95.")
  min_gain = check_number(where, "min_gain", min_gain, lo=0, hi=1, hi_open=True,
                          fix="It is the smallest speed-up that counts, as a fraction: 0.02 for 2%.")
  rounds = DEFAULT_ROUNDS if rounds is None else rounds
  least = min_rounds(confidence)
  check_int(where, "rounds", rounds, lo=least,
            fix=f"A {confidence:.0%} interval of a median needs at least {least} rounds; the default, "
                f"{DEFAULT_ROUNDS}, resolves 5% under 10% timing noise.")
  return int(rounds), float(min_gain), float(confidence)


def _pct(x: float) -> str:
  return f"{x * 100:+.1f}%"


def decide(names: Sequence[str], seconds: Any, *, control: str, min_gain: float = 0.02,
           confidence: float = DEFAULT_CONFIDENCE, processes: int = 1) -> Choice:
  """The decision from a (rounds, steps) array of step times (column i is names[i]).

  Args:
    names: the steps' names, the control's among them.
    seconds: step times, one row per round, every entry > 0 and finite.
    control: the control's name.
    min_gain: the smallest speed-up that counts (fraction).
    confidence: the coverage of each ratio's interval.
    processes: recorded in the Choice.

  Returns:
    The Choice (docs/choose.md has the rule).

  Raises:
    ValueError: a bad shape, a non-positive or non-finite time, too few rounds, or bad options.
  """
  names = tuple(names)
  t = np.asarray(seconds, np.float64)
  if t.ndim != 2 or t.shape[1] != len(names):
    raise ValueError(f"decide: expected step times of shape (rounds, {len(names)}) for steps {names}; "
                     f"got {t.shape}.")
  if control not in names:
    raise ValueError(f"decide(control={control!r}): not among the steps {names}.")
  rounds, min_gain, confidence = check_options("decide", t.shape[0], min_gain, confidence)
  if not np.all(np.isfinite(t)) or np.any(t <= 0):
    r, c = np.argwhere(~(np.isfinite(t) & (t > 0)))[0]
    raise ValueError(f"decide: step {names[c]!r} took {float(t[r, c])!r} s in round {int(r)}; times must be finite "
                     f"and > 0 (a clock that did not advance?).")
  ci = names.index(control)
  ratios, intervals, verdicts = {}, {}, {}
  win = 1.0 / (1.0 + min_gain)
  for i, name in enumerate(names):
    if i == ci:
      continue
    m, lo, hi = median_interval(np.log(t[:, i] / t[:, ci]), confidence)
    ratios[name], intervals[name] = math.exp(m), (math.exp(lo), math.exp(hi))
    hi_r, lo_r = intervals[name][1], intervals[name][0]
    verdicts[name] = "faster" if hi_r < win else "slower" if lo_r > 1.0 + min_gain else "no difference"
  median_s = {n: float(np.median(t[:, i])) for i, n in enumerate(names)}
  winners = sorted((ratios[k], k) for k, v in verdicts.items() if v == "faster")
  conf = f"{confidence:.0%}"
  if winners:
    best = winners[0][1]
    lo, hi = intervals[best]
    reason = (f"{best!r} is faster than the control {control!r}: median time ratio {ratios[best]:.3f} "
              f"({conf} interval [{lo:.3f}, {hi:.3f}]), a speed-up of at least {1 / hi:.3f}x, beyond "
              f"1 + min_gain = {1 + min_gain:g}, over {rounds} interleaved rounds.")
    if winners[1:]:
      reason += f" Also faster, less so: {', '.join(repr(k) for _, k in winners[1:])}."
  else:
    best = control
    parts = []
    for k, v in verdicts.items():
      lo, hi = intervals[k]
      if v == "slower":
        why = f"slower ({_pct(ratios[k] - 1)} time)"
      elif hi < 1.0:
        why = f"faster ({_pct(ratios[k] - 1)} time), but not shown beyond min_gain"
      elif lo > 1.0:
        why = f"slower ({_pct(ratios[k] - 1)} time), within min_gain"
      else:
        why = "no difference"
      parts.append(f"{k!r} {why}: ratio {ratios[k]:.3f}, interval [{lo:.3f}, {hi:.3f}]")
    reason = (f"the control {control!r} stays: no candidate is faster by more than min_gain = "
              f"{min_gain:g} at {conf} confidence over {rounds} rounds ({'; '.join(parts)}).")
  return Choice(best=best, control=control, ratios=ratios, intervals=intervals, verdicts=verdicts,
                reason=reason, median_s=median_s, rounds=rounds, min_gain=min_gain,
                confidence=confidence, processes=int(processes))
