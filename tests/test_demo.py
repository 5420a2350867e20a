"""`make demo` in a reduced form, so the README's main job cannot silently break."""

import json
import subprocess
import sys


def test_demo_quick_prints_the_comparison_and_writes_the_pictures(tmp_path):
  out = subprocess.run([sys.executable, "-m", "prophet_jax", "demo", "--quick", "--steps", "8",
                        "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  text = out.stdout
  assert "schedule auto" in text and "predicted ms" in text and "measured ms" in text
  for policy in ("wfbp", "mgwfbp", "dear", "auto"):
    assert any(line.startswith(policy) for line in text.splitlines()), policy
  assert (tmp_path / "timeline.png").stat().st_size > 10_000
  trace = json.loads((tmp_path / "trace.json").read_text())
  assert any(e.get("cat") == "allreduce" for e in trace["traceEvents"])
  demo = json.loads((tmp_path / "demo.json").read_text())
  assert len(demo["losses"]) == 8 and all(l > 0 for l in demo["losses"])
  assert {r["policy"] for r in demo["policies"]} == {"wfbp", "mgwfbp", "dear", "auto"}
  assert all(r["measured_s"] > 0 and r["predicted_s"] > 0 for r in demo["policies"])
