"""The public surface: every exported name resolves and is documented; pure modules never need jax."""

import importlib
import subprocess
import sys

import pytest

import prophet_jax

PURE = ["prophet_jax", "prophet_jax._values._types", "prophet_jax._values._errors", "prophet_jax.schedulers._plan", "prophet_jax._values._tree",
        "prophet_jax._planning._core", "prophet_jax._planning._paired", "prophet_jax._values._schedule", "prophet_jax._values._schedule_checks", "prophet_jax._values._network", "prophet_jax._values._checks",
        "prophet_jax.launch", "prophet_jax._values._placement", "prophet_jax._values._sharding",
        "prophet_jax._planning._simulate", "prophet_jax._planning._sharded", "prophet_jax._planning._bound", "prophet_jax._planning._timeline",
        "prophet_jax.schedulers", "prophet_jax.schedulers._dear", "prophet_jax._compiled._jaxcompat",
        "prophet_jax.cli"]


@pytest.mark.parametrize("name", prophet_jax.__all__)
def test_every_public_name_resolves_and_has_docs(name):
  obj = getattr(prophet_jax, name)
  assert (getattr(obj, "__doc__", None) or "").strip(), f"prophet_jax.{name} has no docstring"


def test_pure_modules_work_without_jax():
  """With jax made unimportable, the planner and simulator still plan and simulate."""
  code = f"""
import sys
sys.modules['jax'] = None
sys.modules['jaxlib'] = None
import importlib
for m in {PURE!r}:
  importlib.import_module(m)
import prophet_jax as pj
p = pj.GradientProfile.from_params({{'a': {{'w': __import__('numpy').zeros((8, 8), 'float32')}}}},
                                   forward_s=1e-3, backward_s=2e-3)
n = pj.NetworkModel.preset('10gbe', workers=8)
s = pj.plan(p, n, 'wfbp')
d = pj.plan(p, n, 'dear', cross_step=True)
print(pj.simulate(s, p, n).iteration_s > 0, pj.lower_bound(p, n) > 0, d.sharded)
"""
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "True True True"


def test_import_has_no_side_effects():
  out = subprocess.run([sys.executable, "-c", "import sys, prophet_jax; print('jax' in sys.modules)"],
                       capture_output=True, text=True, timeout=60)
  assert out.stdout.strip() == "False", "import prophet_jax must not import jax"


def test_unknown_attribute():
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    prophet_jax.nope  # noqa: B018


def test_the_type_checkers_list_is_the_export_list():
  """`prophet_jax/__init__.py` names each public name twice, for the lazy `__getattr__` (`_EXPORTS`)
  and for type checkers (the imports under TYPE_CHECKING): the two lists must be the same names from
  the same modules."""
  import ast
  import pathlib

  tree = ast.parse(pathlib.Path(prophet_jax.__file__).read_text())
  block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
  typed = {a.asname or a.name: node.module.lstrip(".") for node in ast.walk(block)
           if isinstance(node, ast.ImportFrom) for a in node.names}
  assert typed == prophet_jax._EXPORTS
