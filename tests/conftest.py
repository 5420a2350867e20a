"""Every test sees 8 CPU devices: XLA_FLAGS is set before jax is imported (it reaches child processes).

XLA's backend (LLVM) optimisation level is 0 in the suite: it cuts a CPU train step's compile by 40-50% and
leaves the optimized HLO, which the audits and HLO tests read, byte for byte the same (asserted on a CPU
step in test_transform and on a compile-only H100 step in test_gpu, each against level 3, XLA's default).
Only the machine code is slower, and the suite's steps are tiny. A developer's own
--xla_backend_optimization_level in XLA_FLAGS wins.

For a developer's reruns, jax's persistent compilation cache needs no code here: export
JAX_COMPILATION_CACHE_DIR=/some/dir before `make test`. Nothing sets it, so a fresh clone (CI) compiles
everything and its timings stay honest.

Hypothesis runs derandomized: the same examples on every run, so CI never fails on a draw that a local
run did not see. Set HYPOTHESIS_PROFILE=explore to draw fresh examples (and more of them).
"""

import os

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("explore", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


import pytest  # noqa: E402

pytest_plugins = ["_golden"]  # the golden file of compiled collectives (tests/_golden.py)


@pytest.fixture(scope="session")
def topo():
  """8 compile-only H100s, for the tests that compile for GPUs (marked `gpu`). Fails (never skips) where
  the gpu-compile extra is missing: the test extra includes it."""
  import prophet_jax as pj

  try:
    return pj.gpu_topology("h100", devices=8)
  except pj.GpuCompileError as e:
    pytest.fail(f"{e}\nThe test extra includes gpu-compile: run `make test`, or install it into this "
                f"environment: pip install -e '.[gpu-compile]'.", pytrace=False)
