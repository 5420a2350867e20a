"""The JAX prophet_jax supports: every private name it reads exists in the installed jax (make test and
make test-latest check both ends of the range), a missing one is a clear error, never a silent fallback."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import jax
import pytest

import prophet_jax as pj
from prophet_jax._multiprocess import _distributed
from prophet_jax._compiled import _jaxcompat

ROOT = Path(__file__).resolve().parents[1]


def _version(v: str) -> tuple[int, ...]:
  return tuple(int(x) for x in re.findall(r"\d+", v))


@pytest.mark.parametrize("module,attribute,feature", _jaxcompat.PRIVATE_JAX)
def test_every_private_name_exists_in_this_jax(module, attribute, feature):
  assert _jaxcompat.private(module, attribute, feature=feature) is not None


def test_the_jaxpr_api_exists_in_this_jax():
  _jaxcompat.check_jaxpr_api("this test")
  assert _jaxcompat._jaxpr_api_missing() == ()


def test_no_private_jax_outside_the_inventory():
  """`jax._src` is imported nowhere in the library: every private name goes through `private()`."""
  found = []
  for path in [*(ROOT / "prophet_jax").rglob("*.py"), *(ROOT / "models").rglob("*.py")]:
    for n, line in enumerate(path.read_text().splitlines(), 1):
      if re.match(r"\s*(from\s+jax\._src\b|import\s+jax\._src\b)", line) or "jax.core." in line.split("#")[0]:
        found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
  # jax.core.Tracer is public (models/registry.py checks whether it is being traced)
  assert [f for f in found if "jax.core.Tracer" not in f] == [], found


def test_a_missing_private_name_is_an_error_naming_it(monkeypatch):
  monkeypatch.setattr(_jaxcompat, "PRIVATE_JAX", _jaxcompat.PRIVATE_JAX + (("jax._src.nope", "thing", "x"),))
  with pytest.raises(pj.GlooBindError, match=r"--gloo-interface needs jax's private jax\._src\.nope\.thing, "
                     rf"which jax {re.escape(jax.__version__)} does not have.*tested with jax 0\.10\.2.*"
                     r"or run without"):
    _jaxcompat.private("jax._src.nope", "thing", feature="--gloo-interface", error=pj.GlooBindError,
                       fix="run without --gloo-interface")
  with pytest.raises(AssertionError, match="not in PRIVATE_JAX"):
    _jaxcompat.private("jax._src.core", "Tracer", feature="x")


def test_cluster_detection_without_jax_s_registry_is_an_error_not_a_single_process(monkeypatch):
  """If jax moved its cluster registry, a SLURM job's processes must not each train alone."""
  import jax._src.clusters as clusters  # the private module under test's control

  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
  assert _distributed._cluster_detected() in (False, True)  # this jax has it
  monkeypatch.delattr(clusters.ClusterEnv, "_cluster_types")
  with pytest.raises(pj.LaunchError, match=r"jax\._src\.clusters\.ClusterEnv\._cluster_types.*"
                     r"JAX_COORDINATOR_ADDRESS"):
    _distributed._cluster_detected()
  monkeypatch.undo()

  class Moved:  # an entry whose shape changed
    pass

  monkeypatch.setattr(clusters.ClusterEnv, "_cluster_types", [Moved])
  with pytest.raises(pj.LaunchError, match="entries, whose shape changed"):
    _distributed._cluster_detected()


def test_a_missing_jaxpr_name_is_an_error_naming_it(monkeypatch):
  monkeypatch.setattr(_jaxcompat, "JAXPR_API", _jaxcompat.JAXPR_API + (("jax.extend.core", "NoSuch"),))
  _jaxcompat._jaxpr_api_missing.cache_clear()
  try:
    with pytest.raises(pj.JaxVersionError, match=r"pipelined's residual analysis reads jaxprs through "
                       r"jax\.extend\.core, and jax .* lacks jax\.extend\.core\.NoSuch"):
      _jaxcompat.check_jaxpr_api("pipelined's residual analysis")
  finally:
    monkeypatch.undo()
    _jaxcompat._jaxpr_api_missing.cache_clear()


def test_versions_agree_with_pyproject_and_the_installed_jax():
  deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["jax"]
  ranges = {re.match(r"[\w-]+", d).group(0): d[len(re.match(r"[\w-]+", d).group(0)):] for d in deps}
  assert ranges["jax"] == ranges["jaxlib"] == _jaxcompat.SUPPORTED_JAX
  low, high = (_version(x) for x in re.findall(r"[\d.]+", _jaxcompat.SUPPORTED_JAX))
  for v in (*_jaxcompat.TESTED_JAX_VERSIONS, jax.__version__):
    assert low <= _version(v) < high, v
  assert _distributed.TESTED_JAX_VERSIONS is _jaxcompat.TESTED_JAX_VERSIONS
  # jax >= 0.11 needs Python >= 3.12: make test (Python 3.11) runs the oldest, make test-latest the newest
  if sys.version_info < (3, 12):
    assert jax.__version__ == _jaxcompat.TESTED_JAX_VERSIONS[0]
