"""The golden file of compiled collectives: every program the suite compiles, reduced to its collectives.

A pytest plugin (registered in conftest.py). It wraps jax's compile entry (`jax._src.compiler.
compile_or_get_cached`, which pxla calls for every jit / pmap / shard_map program, CPU or compile-only GPU,
persistent-cache hits included) and reads each executable's optimized HLO, with no extra compile. A
program with collectives becomes one summary line: its collectives in the ENTRY computation's order
(scheduled modules print instructions in schedule order), called computations inlined where they are
called (loop bodies once, as `while*N(...)`; the computation of a `fusion-start` / `async-start`, i.e.
jax 0.12's collective fusions, in the start's place), each as `kind dtype:elements[+...] groups`, an async
`-start` / `-done` pair as its kind with the `-done`'s shape, and `xN` for N identical collectives in a row.
The program is attributed to the running test (its nodeid).

  --golden=check (default)  every program a test compiles must have its summary among that test's golden
                            entries; a test without entries (a new one) is reported, not failed. Where only
                            some of a file's tests run (-k, -m, file.py::test), any test of the file's
                            entries will do: a module fixture compiles in whichever of them runs first.
                            A test marked `golden_measured` (it plans from wall-clock measurements, so
                            its programs vary from run to run) is reported, never failed.
  --golden=record           writes tests/fixtures/golden/jax-X.Y.json (jaxlib's major.minor) when no test
                            failed: the entries of the tests that ran are replaced (those of a whole file
                            that ran, so a removed test's go too), the others kept.
                            Each test file starts cold (jax's caches and the test helpers' functools
                            caches cleared), so it records every program it compiles when it runs first in
                            its process; a check run, where an earlier file in the same xdist worker may
                            have compiled a shared function already, compiles a subset of that.
  --golden=off              nothing is captured.
(`PYTEST_ADDOPTS=--golden=record make test` or `make test-latest` reaches both suites.)

Keys are nodeids: a test renamed or moved to another file needs its key renamed, else it is reported
without entries:  python tests/_golden.py rename OLD NEW   (renames every key starting with OLD).
"""

from __future__ import annotations

import difflib
import functools
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

GOLDEN_DIR = Path(__file__).parent / "fixtures" / "golden"
KINDS = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all",
         "ragged-all-to-all", "collective-broadcast")
_HEAD = re.compile(r"^(ENTRY )?%?([\w.\-]+) ")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")
_CALLEE = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
                     r"|branch_computations=\{([^}]*)\}")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


# ---- summaries (pure text) -------------------------------------------------------------------------

def _attr(rest: str, key: str) -> str:
  """The value of `key=` in an instruction's attributes, up to the next top-level comma ('' if absent)."""
  i = rest.find(key + "=")
  if i < 0:
    return ""
  i += len(key) + 1
  depth = 0
  for j in range(i, len(rest)):
    depth += (rest[j] in "{[(") - (rest[j] in "}])")
    if depth < 0 or (depth == 0 and rest[j] == ","):
      return rest[i:j]
  return rest[i:]


def _ranges(m: re.Match) -> str:
  """'{0,1,2,3,5,6}' -> '{0-3,5,6}'."""
  nums, out = [int(x) for x in m.group(1).split(",")], []
  for n in nums:
    if out and out[-1][1] == n - 1:
      out[-1][1] = n
    else:
      out.append([n, n])
  return "{" + ",".join(f"{a}-{b}" if b - a > 1 else ",".join(map(str, range(a, b + 1)))
                        for a, b in out) + "}"


def _groups(rest: str) -> str:
  g = _attr(rest, "replica_groups") or _attr(rest, "source_target_pairs")
  return re.sub(r"\{([\d,]+)\}", _ranges, g.replace(" ", "")) or "{}"


def _arrays(shape: str) -> str:
  parts = []
  for dtype, dims in _ARRAY.findall(shape):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    parts.append(f"{dtype}:{n}")
  return "+".join(parts)


def _keep(line: str) -> bool:
  """Whether an instruction line may matter: a collective, a `-done`, or a call of another computation."""
  return "=%" in line or "={%" in line or "_groups=" in line or "_pairs=" in line or "-done(" in line


def summarize(text: str) -> str | None:
  """The summary line of an optimized HLO module's collectives; None when it has none."""
  if not any(kind in text for kind in KINDS):
    return None
  comps: dict[str, list] = {}
  entry, lines, done_shape = None, None, {}
  for line in text.splitlines():
    if not line.startswith(" "):
      m = _HEAD.match(line) if line.endswith("{") else None
      lines = comps.setdefault(m.group(2), []) if m else None
      if m and m.group(1):
        entry = m.group(2)
      continue
    m = _INSTR.match(line) if lines is not None and _keep(line) else None
    if m is None:
      continue
    name, shape, op, rest = m.groups()
    if op.endswith("-done"):
      done_shape[rest.split(")")[0].lstrip("%")] = shape
    else:
      lines.append((name, shape, op, rest))
  if entry is None:
    raise ValueError("golden: no ENTRY computation in the HLO text")
  memo: dict[str, list[str]] = {}

  def walk(comp: str) -> list[str]:
    if comp not in memo:
      memo[comp] = []  # guards against cycles
      out = []
      for name, shape, op, rest in comps.get(comp, ()):
        kind = op.removesuffix("-start")
        if kind in KINDS:
          out.append(f"{kind} {_arrays(done_shape.get(name, shape))} {_groups(rest)}")
          continue
        called = []
        for one, branches in _CALLEE.findall(rest):
          called += [one] if one else [b.strip().lstrip("%") for b in branches.split(",")]
        inner = [walk(c) for c in called]
        if op == "while" and any(inner):
          trip = _TRIP.search(rest)
          out += [f"while*{trip.group(1) if trip else '?'}(", *[t for part in inner for t in part], ")"]
        elif op == "conditional" and any(inner):
          out += ["cond(", *[t for i, part in enumerate(inner) for t in ["|"] * (i > 0) + part], ")"]
        else:
          out += [t for part in inner for t in part]
      memo[comp] = out
    return memo[comp]

  tokens = walk(entry)
  if not tokens:
    return None
  runs: list[list] = []
  for t in tokens:
    if runs and runs[-1][0] == t:
      runs[-1][1] += 1
    else:
      runs.append([t, 1])
  return "; ".join(t if n == 1 else f"{t} x{n}" for t, n in runs)


def nearest(summary: str, golden: list[str]) -> tuple[str, str]:
  """The golden summary closest to `summary`, and a diff of their collectives ('-' golden, '+' now)."""
  toks = summary.split("; ")
  best = max(golden, key=lambda g: difflib.SequenceMatcher(None, g.split("; "), toks).ratio())
  diff = difflib.unified_diff(best.split("; "), toks, "golden", "compiled", n=1, lineterm="")
  return best, "\n".join(diff)


# ---- the plugin ------------------------------------------------------------------------------------

def mismatch(summary: str, entries: list[str]) -> str | None:
  """None when `summary` is among a test's golden `entries`, else what to say (the nearest entry, a diff)."""
  if summary in entries:
    return None
  best, diff = nearest(summary, entries) if entries else ("(none)", "")
  return f"  compiled: {summary}\n  nearest:  {best}\n{diff}"


def _hlo_text(executable) -> str:
  """What `jax.stages.Compiled.as_text()` reads: LoadedExecutable.get_hlo_text(), else hlo_modules()."""
  if hasattr(executable, "get_hlo_text"):
    return executable.get_hlo_text()
  return "\n\n".join(m.to_string() for m in executable.hlo_modules())


def _cold_start() -> None:
  """Forgets what earlier test files compiled (jax's caches, the test helpers' functools caches), so a
  record holds everything a file compiles when it runs first in its process."""
  import jax
  jax.clear_caches()
  here = Path(__file__).parent
  for mod in list(sys.modules.values()):
    if Path(getattr(mod, "__file__", None) or "/").parent == here:
      for value in list(vars(mod).values()):
        if callable(getattr(value, "cache_clear", None)):
          value.cache_clear()


class Golden:
  """The plugin's state in one process: the mode, the golden entries, what the tests compiled."""

  def __init__(self, mode: str):
    self.mode = mode
    self.current = None                 # nodeid of the running test
    self.file = None                    # its file
    self.compiled = defaultdict(list)   # nodeid -> summaries, in compile order
    self.unchecked: list = []           # (nodeid, module name, summary) not yet checked
    self.new_tests: set = set()         # compiled collectives, have no golden entries
    self.outside = 0                    # programs with collectives compiled outside any test
    self.hook_error = None
    self.seconds = 0.0                  # CPU time spent reading and summarizing HLO
    self.results: list[dict] = []       # every process's, merged by the controller
    self.partial: set = set()           # files only some of whose tests run (-k, -m, file.py::test)
    self.measured = False               # the running test is marked golden_measured
    self.measured_misses: set = set()   # such tests that compiled a program their entries lack
    self.loose = 0                      # programs found under another test of a partial file
    self.written = False                # record mode: the golden file was written
    self.path = None
    self.golden: dict[str, list[str]] = {}
    if mode != "off":
      self.install()

  def install(self) -> None:
    try:
      import jaxlib
      from jax._src import compiler
      original = compiler.compile_or_get_cached
    except (ImportError, AttributeError) as e:
      self.hook_error = f"jax's compile entry jax._src.compiler.compile_or_get_cached is missing ({e})"
      return
    self.path = GOLDEN_DIR / ("jax-%s.%s.json" % tuple(jaxlib.__version__.split(".")[:2]))
    if self.path.exists():
      self.golden = json.loads(self.path.read_text())

    @functools.wraps(original)
    def compile_or_get_cached(*args, **kwargs):
      executable = original(*args, **kwargs)
      start = time.thread_time()
      try:
        text = _hlo_text(executable)
      except Exception as e:  # noqa: BLE001 - reported: an executable without HLO text is a hole in the net
        self.hook_error = f"no HLO text from a {type(executable).__name__}: {e!r}"
        return executable
      summary = summarize(text)
      if summary is not None and self.current is None:
        self.outside += 1
      elif summary is not None:
        self.compiled[self.current].append(summary)
        self.unchecked.append((self.current, text.split(",", 1)[0].removeprefix("HloModule "), summary))
      self.seconds += time.thread_time() - start
      return executable

    compiler.compile_or_get_cached = compile_or_get_cached

  def start(self, item) -> None:
    self.current = item.nodeid
    self.measured = item.get_closest_marker("golden_measured") is not None
    if self.mode == "record" and item.nodeid.split("::")[0] != self.file:
      _cold_start()
    self.file = item.nodeid.split("::")[0]

  def check(self) -> None:
    """Fails the running test if a program it compiled has a summary its golden entries lack."""
    todo, self.unchecked = self.unchecked, []
    if self.mode != "check":
      return
    bad = []
    for nodeid, name, summary in todo:
      entries, file = self.golden.get(nodeid), nodeid.split("::")[0]
      if entries is None:
        self.new_tests.add(nodeid)
      elif summary in entries:
        pass
      elif file in self.partial and any(summary in v for k, v in self.golden.items()
                                        if k.startswith(file + "::")):
        self.loose += 1  # compiled in another test of its file than in a full run
      elif self.measured:
        self.measured_misses.add(nodeid)
      else:
        bad.append(f"program {name}: its collectives are not among this test's in {self.path.name}\n"
                   + mismatch(summary, entries))
    if bad:
      pytest.fail("golden: " + "\n\n".join(bad) + "\n(an intended change: re-record, see "
                  "docs/development.md)", pytrace=False)


_KEY = pytest.StashKey[Golden]()


def pytest_addoption(parser):
  parser.addoption("--golden", choices=("check", "record", "off"), default="check",
                   help="the golden file of compiled collectives (tests/_golden.py): check (default), "
                        "record or off")


def pytest_configure(config):
  config.addinivalue_line("markers", "golden_measured: the test plans from wall-clock measurements, so its "
                          "compiled programs vary: the golden file reports a program of it that it lacks, "
                          "never fails the test")
  state = config.stash[_KEY] = Golden(config.getoption("golden"))
  if state.mode == "record" and state.hook_error:
    raise pytest.UsageError("golden: " + state.hook_error)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
  item.config.stash[_KEY].start(item)
  return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
  state = item.config.stash[_KEY]
  try:
    result = yield
  except BaseException:
    state.unchecked.clear()  # the test failed already
    raise
  state.check()
  return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
  result = yield
  state = item.config.stash[_KEY]
  state.current = None
  state.check()
  return result


def pytest_sessionfinish(session):
  config = session.config
  state = config.stash[_KEY]
  if state.mode == "off":
    return
  mine = {"compiled": state.compiled, "ran": [i.nodeid for i in session.items],
          "partial": sorted(state.partial), "loose": state.loose, "new": sorted(state.new_tests),
          "measured": sorted(state.measured_misses),
          "outside": state.outside, "hook_error": state.hook_error, "seconds": state.seconds}
  if hasattr(config, "workeroutput"):  # an xdist worker: the controller merges
    config.workeroutput["golden"] = json.dumps(mine)
    return
  state.results.append(mine)
  # a failed test or an unread executable would leave programs out (the controller counts workers' failures)
  state.written = session.testsfailed == 0 and not any(r["hook_error"] for r in state.results)
  if state.mode == "record" and state.written:
    _record(state)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
  if "golden" in getattr(node, "workeroutput", {}):
    node.config.stash[_KEY].results.append(json.loads(node.workeroutput["golden"]))


def pytest_deselected(items):
  if items:
    items[0].config.stash[_KEY].partial.update(i.nodeid.split("::")[0] for i in items)


def pytest_collection_finish(session):
  if any("::" in arg for arg in session.config.args):  # tests named one by one: their files are partial
    session.config.stash[_KEY].partial.update(i.nodeid.split("::")[0] for i in session.items)


def _record(state: Golden) -> None:
  """Replaces the entries of the tests that ran (of every test of a file none of whose tests was
  deselected, so that a removed test's entries go) with what they compiled now."""
  ran = {n for r in state.results for n in r["ran"]}
  whole = {n.split("::")[0] for n in ran} - {f for r in state.results for f in r["partial"]}
  golden = {k: v for k, v in state.golden.items() if k not in ran and k.split("::")[0] not in whole}
  for r in state.results:
    for nodeid, summaries in r["compiled"].items():
      golden[nodeid] = sorted(set(golden.get(nodeid, [])) | set(summaries))
  state.path.parent.mkdir(parents=True, exist_ok=True)
  state.path.write_text(json.dumps(dict(sorted(golden.items())), indent=0) + "\n")


def pytest_terminal_summary(terminalreporter, config):
  state = config.stash[_KEY]
  if state.mode == "off":
    return
  write, results = terminalreporter.write_line, state.results
  tests = {k for r in results for k in r["compiled"]}
  programs = sum(len(v) for r in results for v in r["compiled"].values())
  seconds = sum(r["seconds"] for r in results)
  write(f"golden ({state.mode}, {state.path and state.path.name}): {programs} programs with collectives "
        f"in {len(tests)} tests, {seconds:.2f} s CPU reading HLO"
        + ("" if state.mode != "record" else f", written to {state.path}" if state.written
           else ", NOT written: a test failed or an executable was not read"))
  for e in {r["hook_error"] for r in results if r["hook_error"]}:
    write(f"golden: NOT CHECKED: {e}", red=True)
  new = sorted({n for r in results for n in r["new"]})
  if new:
    write(f"golden: {len(new)} tests compiled collectives and have no golden entries (not checked): "
          + ", ".join(new))
  measured = sorted({n for r in results for n in r["measured"]})
  if measured:
    write(f"golden: {len(measured)} tests marked golden_measured compiled programs their entries lack "
          "(reported, not failed): " + ", ".join(measured))
  if loose := sum(r["loose"] for r in results):
    write(f"golden: {loose} programs found under another test of their file (only some of its tests ran)")
  if outside := sum(r["outside"] for r in results):
    write(f"golden: {outside} programs with collectives compiled outside any test (not checked)")


def _rename(old: str, new: str) -> None:
  for path in sorted(GOLDEN_DIR.glob("jax-*.json")):
    golden = json.loads(path.read_text())
    renamed = {(new + k[len(old):] if k.startswith(old) else k): v for k, v in golden.items()}
    n = sum(k.startswith(old) for k in golden)
    path.write_text(json.dumps(dict(sorted(renamed.items())), indent=0) + "\n")
    print(f"{path}: {n} keys renamed")


if __name__ == "__main__":
  if len(sys.argv) != 4 or sys.argv[1] != "rename":
    sys.exit("usage: python tests/_golden.py rename OLD NEW   (every key starting with OLD)")
  _rename(sys.argv[2], sys.argv[3])
