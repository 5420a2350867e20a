"""bench/gpu_step.py, the one-GPU measurement of issue 23, runs: its CPU dry run (QUICK=1) end to end."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_step_dry_run_on_the_cpu_writes_every_section(tmp_path):
  env = dict(os.environ, QUICK="1", JAX_PLATFORMS="cpu", OUT=str(tmp_path))
  # one device, as on one GPU; the suite's backend optimisation level (tests/conftest.py) for its compiles
  env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
  p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_step.py")], env=env, capture_output=True,
                     text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  (out,) = tmp_path.glob("gpu_step-*.json")
  assert out.name == "gpu_step-cpu-quick.json"
  res = json.loads(out.read_text())
  assert res["quick"] is True
  env_ = res["sections"]["env"]["result"]
  assert env_["device_kind"] == "cpu" and env_["jax"] and env_["prophet_jax"]
  prof = res["sections"]["profile-mlp"]
  assert prof["ok"], prof.get("traceback")
  r = prof["result"]
  assert r["method"] == "measured" and r["rows"] == 24 and r["plain_step"]["median_ms"] > 0
  assert r["profile_from_trace"]["backward_ms"] > 0 and r["layers"] == 12
  ovh = res["sections"]["overhead-mlp"]
  assert ovh["ok"], ovh.get("traceback")
  assert set(ovh["result"]["ratio_vs_plain"]) == {"plain", "wfbp", "auto", "dlcp", "pipelined", "pipelined-all"}
  assert set(ovh["result"]["compile_s"]) == set(ovh["result"]["ratio_vs_plain"])
  assert "=== gpu_step: cpu ===" in p.stdout
