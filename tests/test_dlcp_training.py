"""Training with dlcp's deferral (issue 27): a fast check of `bench/dlcp.py --part convergence`.

The issue's small CNN (conv 16, conv 32 stride 2, dense 64, dense 10 on a fixed teacher-labelled
task), sgd with momentum under `jax.pmap` on 8 host devices through `scheduled`, with dlcp's plan at
max_defer 0.25 on issue 27's slow link: it defers a quarter of the elements (from Dense_0; never from
the first or the last layer) and, with the default damped feedback (`release` 0.05), ends at most 2% above
the lossless run's final loss (mean of the last 10 steps; the bench's 120 steps, seed 0). The control:
the same plan sending a deferred chunk's whole residual at the next step (`release=1`, the one-step-late
feedback of issue 18) ends 6.9% above the lossless run, so the test fails if the damping is lost. The
bench measures the full table (3 seeds, the MLP too, adamw) and the README reports it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import dlcp as bench  # noqa: E402

STEPS = 120


@pytest.mark.filterwarnings("ignore::prophet_jax._values._errors.DeferralWarning")
def test_cnn_with_a_quarter_deferred_ends_within_2_percent_of_lossless_and_undamped_does_not():
  lossless = bench.conv_plan("cnn", 0.0)
  plan = bench.conv_plan("cnn", 0.25)
  assert 0.2 < plan.max_deferred_fraction <= 0.25 and plan.predicted_s < 0.9 * lossless.predicted_s
  assert {b.release for b in plan.buckets if b.defer} == {0.05}
  layers = [path.split("/")[0] for path, _, _ in plan.rows]
  waiting = {layers[r] for b in plan.buckets if b.defer for c in b.chunks for r in c.rows}
  assert waiting == {"Dense_0"}        # the first (Conv_0) and the last (Dense_1) layer never wait
  base = bench._final(bench.train("cnn", lossless, "sgdm", 0, steps=STEPS))
  got = bench._final(bench.train("cnn", plan, "sgdm", 0, steps=STEPS))
  assert got != base                   # the deferral changed the training
  assert got / base - 1 <= 0.02, (got, base)   # as the bench's verdict: at most 2% above (seed 0: -1.7%)
  undamped = bench._final(bench.train("cnn", bench.conv_plan("cnn", 0.25, release=1.0), "sgdm", 0, steps=STEPS))
  assert undamped / base - 1 > 0.04, (undamped, base)
