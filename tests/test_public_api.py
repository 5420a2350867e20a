"""The public surface: every exported name resolves and is documented; pure modules never need jax."""

import importlib
import subprocess
import sys

import pytest

import prophet_jax

PURE = ["prophet_jax", "prophet_jax._types", "prophet_jax._errors", "prophet_jax._plan", "prophet_jax._tree",
        "prophet_jax._core", "prophet_jax._schedule", "prophet_jax.launch",
        "prophet_jax._simulate", "prophet_jax._bound", "prophet_jax._timeline", "prophet_jax.schedulers",
        "prophet_jax._jaxcompat",
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
print(pj.simulate(s, p, n).iteration_s > 0, pj.lower_bound(p, n) > 0)
"""
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "True True"


def test_import_has_no_side_effects():
  out = subprocess.run([sys.executable, "-c", "import sys, prophet_jax; print('jax' in sys.modules)"],
                       capture_output=True, text=True, timeout=60)
  assert out.stdout.strip() == "False", "import prophet_jax must not import jax"


def test_unknown_attribute():
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    prophet_jax.nope  # noqa: B018
