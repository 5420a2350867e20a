"""The README's first snippet as a new user runs it: saved as a file, run as fresh processes on 8 host devices.

The snippet (README.md, "Start: a plain `jax.jit` step on global arrays") needs `loss_fn`, `params`,
`batch`, `batches` and `model`: a prelude makes them from the bundled `mlp` (as tests/test_readme.py
does), then the snippet runs as written (the real `profile_step` and `measure_network`), then the loss is
printed. Each process is timed whole, jax's import included; the median of `--runs` is the number
(issue 46 asks for <= 10 s on 2 cores). Prints the times and writes bench/results/first_contact.json.

    .venv/bin/python bench/first_contact.py [--runs 5] [--repo DIR] [--out FILE]

`--repo` runs another checkout's package (PYTHONPATH=DIR), e.g. a worktree of an older commit, with this
checkout's README snippet.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
SECTION = "## Start: a plain `jax.jit` step on global arrays"
PRELUDE = """import jax
from prophet_jax.models import get_model
model = get_model("mlp")
params = model.init(jax.random.key(0))
loss_fn = model.loss_fn
batches = [jax.device_get(model.make_batch(jax.random.key(10 + i), 16)) for i in range(2)]
batch = batches[0]
"""


def snippet() -> str:
  text = (ROOT / "README.md").read_text()
  return re.compile(r"```python\n(.*?)```", re.S).search(text, text.index(SECTION)).group(1)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--runs", type=int, default=5)
  ap.add_argument("--repo", default=str(ROOT), help="the checkout whose prophet_jax runs (default: this one)")
  ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "first_contact.json"))
  a = ap.parse_args()
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": a.repo}
  times, loads = [], []
  with tempfile.TemporaryDirectory() as d:
    path = pathlib.Path(d) / "snippet.py"
    path.write_text(PRELUDE + snippet() + "print('loss', float(loss))\n")
    for _ in range(a.runs):
      t0 = time.perf_counter()
      r = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, cwd=d)
      times.append(time.perf_counter() - t0)
      loads.append(os.getloadavg()[0])
      if r.returncode:
        sys.exit(f"the snippet failed:\n{r.stderr[-2000:]}")
      print(f"{times[-1]:.2f} s (load {loads[-1]:.1f})", flush=True)
  record = {"repo": a.repo, "runs": a.runs, "seconds": times, "median_s": statistics.median(times),
            "load_average": loads, "cpus": os.cpu_count()}
  print(f"median {record['median_s']:.2f} s over {a.runs} fresh processes ({os.cpu_count()} CPUs)")
  pathlib.Path(a.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
  main()
