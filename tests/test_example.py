"""examples/train_flax.py under launch: a worker killed mid-run stops the launch, naming the rank (the
example's two-process numerics are in test_two_processes.py, in the suite's one launch of the checks)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _example_ref import example_env


ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "train_flax.py")
PY = sys.executable

pytestmark = pytest.mark.multiprocess



def test_killed_worker_stops_the_launch():
  cmd = [PY, "-m", "prophet_jax.launch", "--nproc", "2", "--", PY, EXAMPLE, "--model", "mlp",
         "--steps", "400", "--step-delay", "0.2", "--log-every", "1"]
  p = subprocess.Popen(cmd, env=example_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
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
