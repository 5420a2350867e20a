"""The package's layout: stages whose imports point down, modules of at most 600 lines, placement
decided in the mesh layer alone. Read from the source (nothing is imported or run)."""

import ast
import io
import pathlib
import tokenize

import pytest

import prophet_jax

ROOT = pathlib.Path(prophet_jax.__file__).parent

# The pipeline's stages, bottom to top: a module imports only from its own stage or the ones below.
STAGES = {
    "_values": 0,                               # pure values: profile, network, schedule, tree, checks
    "_planning": 1,                             # pure numpy: the core, simulation, bounds
    "schedulers": 2,                            # pure numpy: the policies, and plan() above them
    "_compiled": 3,                             # reading compiled programs; GPU targets; mesh geometry
    "_measure": 4,                              # profiling a step, reading traces, probing the network
    "_rewrite": 5,                              # the engine, states, front-ends and the mesh layer
    "_multiprocess": 6,                         # distributed start, launcher, agreement, monitor
    "cli": 7, "launch": 7, "_steps": 7, "_demo": 7, "__main__": 7, "prophet_jax": 7,   # front doors
}
STAGE_NAMES = ["values", "planning", "policies", "compiled", "measure", "rewrite", "multiprocess", "front doors"]
MAX_LINES = 600
MESH_LAYER = {"_rewrite/_mesh.py", "_compiled/_devices.py"}  # placement (is there a mesh?) is decided here


def _modules() -> dict[str, pathlib.Path]:
  mods = {}
  for path in ROOT.rglob("*.py"):
    name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
    mods[name.removesuffix(".__init__")] = path
  return mods


def _import_graph() -> dict[str, set[str]]:
  """{module: modules of the package it imports (at the top or inside a function)}; `prophet_jax`
  itself (the lazy front door) counts as a module of the top stage."""
  mods = _modules()
  graph = {}
  for name, path in mods.items():
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom):
        base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1] if node.level else []
        target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
        cands = [f"{target}.{a.name}" for a in node.names]
        cands = [c for c in cands if c in mods] or [target]   # `from . import _x` names module _x
      elif isinstance(node, ast.Import):
        cands = [a.name for a in node.names]
      else:
        continue
      out |= {c for c in cands if c in mods and c != name}
    graph[name] = out
  return graph


def stage(module: str) -> int:
  """The stage of a module of the package, by its first component below `prophet_jax`."""
  parts = module.split(".")
  key = parts[1] if len(parts) > 1 else parts[0]
  if key not in STAGES:
    raise AssertionError(f"module {module!r} is in no stage: place it in a stage subpackage (or name it "
                         f"in tests/test_layout.py's STAGES if it is a new front door)")
  return STAGES[key]


def _upward(graph: dict[str, set[str]]) -> list[str]:
  return [f"{m} ({STAGE_NAMES[stage(m)]}) imports {d} ({STAGE_NAMES[stage(d)]})"
          for m, deps in sorted(graph.items()) if m != "prophet_jax" for d in sorted(deps) if stage(d) > stage(m)]


def test_every_import_points_down_or_within_its_stage():
  """values < planning < policies (schedulers, plan) < compiled < measure < rewrite < multiprocess < front doors:
  every import in the package, in-function ones included, points to a stage at or below its own."""
  up = _upward(_import_graph())
  assert not up, "imports pointing up the stages:\n  " + "\n  ".join(up)


def test_the_stage_test_sees_an_upward_import():
  """The control: the graph holds the in-function and relative imports the stage test judges, and
  the test reports the arrow measurement had to the rewrite's mesh before this layout."""
  graph = _import_graph()
  assert "prophet_jax._compiled._devices" in graph["prophet_jax._measure._profile_harness"]
  assert "prophet_jax._measure._profile" in graph["prophet_jax.cli"]            # inside a function
  graph["prophet_jax._measure._profile"] = graph["prophet_jax._measure._profile"] | {"prophet_jax._rewrite._mesh"}
  assert _upward(graph) == ["prophet_jax._measure._profile (measure) imports prophet_jax._rewrite._mesh (rewrite)"]


def test_no_import_cycle():
  """No import cycle among the package's modules (an import inside a function counts): each module
  sits on a floor above everything it imports. The front door re-exports everything, lazily, and is
  left out."""
  graph = {m: deps - {"prophet_jax"} for m, deps in _import_graph().items() if m != "prophet_jax"}
  floor: dict[str, int] = {}

  def place(m, path=()):
    if m in path:
      raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + (m,)))
    if m not in floor:
      floor[m] = 1 + max((place(d, path + (m,)) for d in graph[m]), default=-1)
    return floor[m]

  for m in graph:
    place(m)


def _long(inside_rewrite: bool) -> list[str]:
  return [f"{p.relative_to(ROOT)}: {n} lines" for p in sorted(ROOT.rglob("*.py"))
          if (p.relative_to(ROOT).parts[0] == "_rewrite") == inside_rewrite
          and (n := len(p.read_text().splitlines())) > MAX_LINES]


def test_no_module_over_600_lines():
  """One concept a module: none is longer than 600 lines."""
  assert not _long(inside_rewrite=False), _long(inside_rewrite=False)


def test_no_rewrite_module_over_600_lines():
  """The same for the rewrite stage."""
  assert not _long(inside_rewrite=True), _long(inside_rewrite=True)


def _placement_tests() -> list[str]:
  found = []
  for p in sorted(ROOT.rglob("*.py")):
    rel = p.relative_to(ROOT).as_posix()
    for i, line in enumerate(p.read_text().splitlines(), 1):
      if rel not in MESH_LAYER and ("mesh is None" in line or "mesh is not None" in line):
        found.append(f"{rel}:{i}: {line.strip()}")
  return found


def test_placement_is_decided_outside_the_rewrite_only_in_the_mesh_geometry():
  """Placement is one layer: no module outside the mesh layer asks whether it was given a mesh."""
  outside = [f for f in _placement_tests() if not f.startswith("_rewrite/")]
  assert not outside, outside


def test_placement_is_decided_only_in_the_mesh_layer():
  """Every front-end is written once, per device; `mesh=` is one wrapper over it: no `mesh is None` /
  `mesh is not None` test outside `_rewrite/_mesh.py` (and the mesh geometry under it)."""
  assert not _placement_tests(), _placement_tests()


def _silent_imports(inside_rewrite: bool) -> list[str]:
  """In-function imports with no reason beside them: a comment on the import's line, on the line
  above, or on an import line of the same block just above it."""
  found = []
  for p in sorted(ROOT.rglob("*.py")):
    rel = p.relative_to(ROOT)
    if (rel.parts[0] == "_rewrite") != inside_rewrite:
      continue
    lines = p.read_text().splitlines()
    nested = {n.lineno for f in ast.walk(ast.parse(p.read_text()))
              if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    for no in sorted(nested):
      i = no - 1
      while True:
        if "#" in lines[i] or lines[i - 1].strip().startswith("#"):
          break
        j = i - 1
        while j > 0 and not lines[j].strip():
          j -= 1
        if j + 1 in nested:
          i = j
          continue
        found.append(f"{rel}:{no}: {lines[no - 1].strip()}")
        break
  return found


def test_every_in_function_import_says_why():
  """An import inside a function hides a dependency from the top of the module: each says why it is
  there (a pure module importing jax lazily, a front door that starts without jax, ...)."""
  assert not _silent_imports(inside_rewrite=False), _silent_imports(inside_rewrite=False)


def test_every_in_function_import_in_the_rewrite_says_why():
  """The same for the rewrite stage."""
  assert not _silent_imports(inside_rewrite=True), _silent_imports(inside_rewrite=True)


# --------------------------------------------------------------------------------------------------
# bench/ and examples/ on the public surface

REPO = ROOT.parent
# The scripts that study internals, each saying why at its top ("... imports private code ...").
STUDIES_INTERNALS = {
    "bench/auto_gap.py",      # runs auto's own search engine deeper (an oracle of the same engine)
    "bench/choose.py",        # choose's decision rule on an injected clock (--power), no steps
    "bench/fdo_profile.py",   # XLA's cost profile keyed by the compiled program's instruction names
    "bench/xla_options.py",   # thresholds vs plans: the compiled all-reduces read with the HLO reader
    "bench/fsdp.py",          # the modelled partitioner's schedule on the fsdp planner's own units
    "bench/fsdp_hlo.py",      # the partitioner's compiled FSDP program read into a Schedule (FsdpPlan)
    "bench/fsdp_mechanism.py",  # the FSDP step's per-device core (not public yet) and its compiled schedules
    "bench/gpu_ordering.py",  # the tie itself against jax's ordering means
    "bench/gpu_work.py",      # per-op costs from the library's HLO cost model
    "bench/profile_time.py",  # the measure step's phases, timed one by one
}


def _private_imports(path: pathlib.Path) -> list[str]:
  """The private names of prophet_jax a script imports (at the top or in a function)."""
  out = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "prophet_jax":
      names = node.module.split(".") + [a.name for a in node.names]
    elif isinstance(node, ast.Import):
      names = [part for a in node.names if a.name.split(".")[0] == "prophet_jax" for part in a.name.split(".")]
    else:
      continue
    if any(n.startswith("_") for n in names):
      out.append(f"line {node.lineno}: {ast.unparse(node)}")
  return out


def test_bench_and_examples_use_the_public_surface():
  """bench/ and examples/ import only public names (`prophet_jax`, `.schedulers`, `.launch`,
  `.models`), except the listed scripts that study internals, each with its reason at its top; a
  listed script that no longer needs private code leaves the list."""
  scripts = sorted(p for d in ("bench", "examples") for p in (REPO / d).glob("*.py"))
  assert len(scripts) > 10
  found = {p.relative_to(REPO).as_posix(): _private_imports(p) for p in scripts}
  unlisted = {k: v for k, v in found.items() if v and k not in STUDIES_INTERNALS}
  assert not unlisted, f"private imports outside the listed studies of internals: {unlisted}"
  for name in STUDIES_INTERNALS:
    assert found.get(name), f"{name} imports no private code any more: take it off STUDIES_INTERNALS"
    doc = " ".join((ast.get_docstring(ast.parse((REPO / name).read_text())) or "").split())
    assert "imports private code" in doc, f"{name}: say at its top why it imports private code"


# --------------------------------------------------------------------------------------------------
# one place per rule: the family, the state kinds, plain names across modules, the code's size

# Schedule.family (and its derived `sharded`) is read where a choice between families is made, and nowhere
# else: the reduction-layer chooser, the hook-plan builder and conversion's layout step in the rewrite;
# simulate (and the bounds it reports), auto, the audit and xla_options / tag_plan outside it.
FAMILY_READERS = {
    "_rewrite/_reduction.py": "reduction_kind: the reduction layer a family asks for (scheduled, pipelined, allreduce)",
    "_rewrite/_hooked.py": "hook_plan: the hook groups and their collectives",
    "_rewrite/_convert.py": "the conversion's layout step (ZeRO-1 shards cut or gathered)",
    "_rewrite/_tagging.py": "tag_plan / tag_layers",
    "_planning/_simulate.py": "simulate", "_planning/_bound.py": "lower_bound (simulate's bound)",
    "_planning/_fsdp_bound.py": "the FSDP bound", "schedulers/_auto.py": "auto",
    "_compiled/_audit.py": "audit", "_compiled/_audit_report.py": "audit", "_compiled/_keyed_audit.py": "audit",
    "_compiled/_xla_options.py": "xla_options",
}
KIND_NAMES = {"DeferState", "ShardedState", "GradShards", "AccumState", "OwedState", "ScheduledState",
              "PipelinedState"}


def _family_reads() -> dict[str, int]:
  out: dict[str, int] = {}
  for p in sorted(ROOT.rglob("*.py")):
    rel = p.relative_to(ROOT).as_posix()
    if rel == "_values/_schedule.py":
      continue
    for node in ast.walk(ast.parse(p.read_text())):
      if (isinstance(node, ast.Attribute) and node.attr in ("family", "sharded") and isinstance(node.ctx, ast.Load)
          and not (isinstance(node.value, ast.Name) and node.value.id == "profile")):   # GradientProfile.sharded
        out[rel] = out.get(rel, 0) + 1
  return out


def test_the_family_is_read_only_where_families_are_chosen():
  reads = _family_reads()
  assert set(reads) <= set(FAMILY_READERS), {k: v for k, v in reads.items() if k not in FAMILY_READERS}
  assert reads.get("_rewrite/_reduction.py") and reads.get("_rewrite/_hooked.py")   # the readers are found


def _kind_dispatches() -> dict[str, int]:
  """isinstance(x, <a state kind>) per module."""
  out: dict[str, int] = {}
  for p in sorted(ROOT.rglob("*.py")):
    for node in ast.walk(ast.parse(p.read_text())):
      if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
          and len(node.args) == 2 and {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} & KIND_NAMES):
        rel = p.relative_to(ROOT).as_posix()
        out[rel] = out.get(rel, 0) + 1
  return out


def test_the_state_kinds_are_declared_once_and_dispatched_in_few_places():
  """Each kind declares its per-device fields, nnx path and conversion step once (`_states.declare`); the
  generic helpers read that, so a dispatch on a kind's type is rare and kept to the state layer's modules."""
  found = _kind_dispatches()
  assert sum(found.values()) <= 15 and len(found) <= 4, found
  from prophet_jax._rewrite import _pending, _states   # noqa: F401 (the declarations register on import)
  assert {c.__name__ for c in _states.KINDS} == KIND_NAMES


def _private_names() -> set[tuple[str, str]]:
  """(module, name) of the underscored names one module of the package takes from another."""
  mods = {".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): p
          for p in ROOT.rglob("*.py")}
  pairs = set()
  for name, path in mods.items():
    pkg = (name if path.name == "__init__.py" else name.rsplit(".", 1)[0]).split(".")
    aliases = {}
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom):
        src = ".".join(pkg[:len(pkg) - node.level + 1] + ([node.module] if node.module else [])) if node.level \
            else node.module or ""
        for a in node.names:
          if f"{src}.{a.name}" in mods:
            aliases[a.asname or a.name] = f"{src}.{a.name}"
          elif a.name.startswith("_") and not a.name.startswith("__") and src != name and src in mods:
            pairs.add((src, a.name))
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
          and node.attr.startswith("_") and not node.attr.startswith("__") and aliases[node.value.id] != name):
        pairs.add((aliases[node.value.id], node.attr))
  return pairs


def test_a_name_another_module_takes_is_plain():
  """One concept per private module, plain names inside: fewer than 20 underscored names cross a module
  (54 at 7963a23)."""
  assert len(_private_names()) < 20, sorted(_private_names())


def _code_and_docstring_lines(paths) -> tuple[int, int, int]:
  """(lines holding code, docstring lines, all lines), by `ast` and the tokenizer."""
  code = doc = total = 0
  for p in paths:
    src = p.read_text()
    docs = set()
    for node in ast.walk(ast.parse(src)):
      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body and \
          isinstance(node.body[0], ast.Expr) and isinstance(getattr(node.body[0], "value", None), ast.Constant) \
          and isinstance(node.body[0].value.value, str):
        docs.update(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
      if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                          tokenize.ENDMARKER):
        lines.update(ln for ln in range(tok.start[0], tok.end[0] + 1) if ln not in docs)
    code, doc, total = code + len(lines), doc + len(docs), total + len(src.splitlines())
  return code, doc, total


# The modules issues 47 and 48 added for FSDP and HSDP in the user's step (the step, its audit, scanned stacks,
# accumulation's planning); what they added inside older modules counts in the rest
FSDP_STEP = ("_rewrite/_fsdp_step.py", "_rewrite/_fsdp_trace.py", "_rewrite/_fsdp_units.py", "_rewrite/_fsdp_scan.py",
             "_compiled/_audit_fsdp.py", "_values/_stacks.py", "_planning/_fsdp_accum.py")
CODE_LINES = 14_508 - 500        # the library at 7963a23 less the restructuring's cut, every feature kept
FSDP_STEP_LINES = 1_500 + 800    # issue 47's budget for carrying FSDP plans out, and issue 48's (HSDP, accumulation)


def test_the_library_holds_fewer_code_lines_and_docstrings_say_what_not_why():
  paths = [p for p in sorted(ROOT.rglob("*.py")) if "targets" not in p.parts]
  fsdp = [p for p in paths if p.relative_to(ROOT).as_posix() in FSDP_STEP]
  rest = [p for p in paths if p not in fsdp]
  assert len(fsdp) == len(FSDP_STEP)
  assert _code_and_docstring_lines(rest)[0] <= CODE_LINES, _code_and_docstring_lines(rest)
  assert _code_and_docstring_lines(fsdp)[0] <= FSDP_STEP_LINES, _code_and_docstring_lines(fsdp)
  code, doc, total = _code_and_docstring_lines(paths)
  assert doc < 0.2 * total, f"docstrings {doc} of {total} lines ({doc / total:.1%}): the long form goes to docs/"
