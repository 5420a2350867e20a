"""examples/train_flax.py: the 8-device single-process run and the 2x4 run under launch end with the same
parameters (docs/design.md, "Equivalence tolerance"); a worker killed mid-run stops the launch, naming the rank."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from _example_ref import example_env, load_npz

from tests._assert import assert_trees_close

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "train_flax.py")
PY = sys.executable
STEPS = 3

pytestmark = pytest.mark.multiprocess


_env, _load = example_env, load_npz


def _initial_params():
  import jax

  from prophet_jax._values._tree import flatten_with_paths
  from prophet_jax.models import get_model

  params = get_model("mlp").init(jax.random.key(0))
  return {p: np.asarray(x) for p, x in flatten_with_paths(params)}


def test_two_processes_match_one_process(tmp_path):
  one, two = tmp_path / "one.npz", tmp_path / "two.npz"
  args = ["--model", "mlp", "--steps", str(STEPS), "--policy", "mgwfbp"]
  r1 = subprocess.run([PY, EXAMPLE, *args, "--out", str(one)], env=_env(), capture_output=True,
                      text=True, timeout=240)
  assert r1.returncode == 0, r1.stdout + r1.stderr
  assert "1 process(es) x 8 device(s)" in r1.stdout
  r2 = subprocess.run([PY, "-m", "prophet_jax.launch", "--nproc", "2", "--", PY, EXAMPLE, *args,
                       "--out", str(two)], env=_env(), capture_output=True, text=True, timeout=240)
  assert r2.returncode == 0, r2.stdout + r2.stderr
  assert "[rank 0] rank 0 of 2" in r2.stdout and "[rank 1] rank 1 of 2" in r2.stdout
  assert "[rank 0] 3 steps in" in r2.stdout and "2 process(es) x 4 device(s)" in r2.stdout

  before, ref, got = _initial_params(), _load(one), _load(two)
  assert sorted(ref) == sorted(got) == sorted(before)
  assert all(np.max(np.abs(ref[k] - before[k])) > 0 for k in ref), "training did not move every leaf"
  assert_trees_close(got, ref, before)
  # the check discriminates: a 1% larger update (or a lost slice) fails it
  wrong = {k: before[k] + 1.01 * (got[k] - before[k]) for k in got}
  with pytest.raises(AssertionError):
    assert_trees_close(wrong, ref, before)
  k0 = sorted(got)[0]
  lost = dict(got, **{k0: np.where(np.arange(got[k0].size).reshape(got[k0].shape) == 0, before[k0], got[k0])})
  with pytest.raises(AssertionError, match=re.escape(k0)):
    assert_trees_close(lost, ref, before)


def test_killed_worker_stops_the_launch():
  cmd = [PY, "-m", "prophet_jax.launch", "--nproc", "2", "--", PY, EXAMPLE, "--model", "mlp",
         "--steps", "400", "--step-delay", "0.2", "--log-every", "1"]
  p = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       start_new_session=True)
  try:
    pid, stepping = None, False
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not (pid and stepping):
      line = p.stdout.readline()
      if not line:
        break
      m = re.match(r"\[rank 1\] rank 1 of 2: pid (\d+)", line)
      pid = int(m.group(1)) if m else pid
      stepping = stepping or line.startswith("[rank 0] step    1")
    assert pid and stepping, "the run did not start training"
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    out, err = p.communicate(timeout=60)
    assert time.monotonic() - t0 < 60
  finally:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGKILL)
      p.wait()
  assert p.returncode != 0
  assert "rank 1" in err and "killed by SIGKILL" in err, err
