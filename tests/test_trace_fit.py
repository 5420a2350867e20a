"""The alpha-beta fit from a training run's own all-reduces (MG-WFBP's way), on synthetic and real logs.

Pure: these tests never import jax.
"""

from __future__ import annotations

import numpy as np
import pytest

from prophet_jax import NetworkModel, plan, simulate
from prophet_jax._values._errors import NetworkError, TraceUnavailableError
from prophet_jax.models import (fit_allreduce, googlenet_available, googlenet_layer_allreduce,
                                googlenet_merged_groups, googlenet_network, load_trace)
from prophet_jax.models import _traces

GOOGLENET_OK, GOOGLENET_WHY = googlenet_available()
needs_googlenet = pytest.mark.skipif(not GOOGLENET_OK, reason=GOOGLENET_WHY)
A_S, B_S_PER_BYTE = 1.5e-3, 3.5e-9   # a = 2(P-1) alpha_s and b = 2(P-1)/P beta of the synthetic runs


def _noisy_run(rng, sizes, repeats):
  """Times a + b·M with 2% noise, and a fifth of the small messages 5-10x slow (the tbf-link pattern)."""
  t = (A_S + B_S_PER_BYTE * sizes)[:, None] * rng.normal(1.0, 0.02, size=(len(sizes), repeats))
  slow = (sizes < 300_000)[:, None] & (rng.random(t.shape) < 0.2)
  return np.where(slow, t * rng.uniform(5, 10, size=t.shape), t)


def test_fit_recovers_alpha_and_beta_despite_slow_small_messages():
  rng = np.random.default_rng(0)
  sizes = np.geomspace(256, 8e6, 60)
  m = fit_allreduce(sizes, _noisy_run(rng, sizes, 3), workers=8)
  assert m.workers == 8 and m.overlap and m.name == "fit"
  assert m.per_byte_s == pytest.approx(B_S_PER_BYTE, rel=0.03)      # never pulled below the link's cost
  assert m.startup_s == pytest.approx(A_S, rel=0.2)
  assert m.alpha_s == pytest.approx(m.startup_s / 14)
  assert m.beta_s_per_byte == pytest.approx(m.per_byte_s * 8 / 14)
  # without setting the outliers aside, plain squares are tilted: a up, b down (below the link's cost)
  plain = fit_allreduce(sizes, _noisy_run(np.random.default_rng(0), sizes, 3), workers=8, reject=None)
  assert plain.per_byte_s < 0.97 * B_S_PER_BYTE and plain.startup_s > 1.3 * A_S
  for seed in range(1, 5):   # and the result holds across runs
    r = fit_allreduce(sizes, _noisy_run(np.random.default_rng(seed), sizes, 3), workers=8)
    assert r.per_byte_s == pytest.approx(B_S_PER_BYTE, rel=0.03), seed


def test_fit_takes_medians_over_repeats_and_rejects_bad_input():
  # one size measured 3 times (one slow) counts once, at its median
  m = fit_allreduce([1e3, 1e6, 1e6, 1e6, 4e6], [0.001002, 0.003, 0.003, 0.010, 0.009], workers=2)
  assert m.startup_s == pytest.approx(1e-3) and m.per_byte_s == pytest.approx(2e-9)
  assert m.fit_residual_s == pytest.approx(0, abs=1e-12)
  # (n, repeats) with NaN for a missing repeat is the same data
  m2 = fit_allreduce([1e3, 1e6, 4e6], [[0.001002, np.nan], [0.003, 0.003], [0.009, np.nan]], workers=2)
  assert (m2.alpha_s, m2.beta_s_per_byte) == pytest.approx((m.alpha_s, m.beta_s_per_byte))
  with pytest.raises(NetworkError, match=r"line rate 100 MB/s.*fit is wrong"):
    fit_allreduce([1e3, 1e6], [0.001, 0.002], workers=2, line_rate_bytes_per_s=1e8)   # 1 GB/s fitted
  with pytest.raises(NetworkError, match=r"2 distinct message sizes.*\(1000\.0,\)"):
    fit_allreduce([1e3, 1e3], [0.001, 0.002], workers=2)
  with pytest.raises(NetworkError, match="workers=1"):
    fit_allreduce([1e3, 1e6], [0.001, 0.002], workers=1)
  with pytest.raises(NetworkError, match=r"shape \(2,\).*shape \(3, 1\)"):
    fit_allreduce([1e3, 1e6], [0.001, 0.002, 0.003], workers=2)
  with pytest.raises(NetworkError, match="finite"):
    fit_allreduce([1e3, 1e6], [0.001, np.inf], workers=2)


def _write_logs(root, rng):
  """A synthetic googlenet-caffe-k80 directory: GoogLeNet's counts, times from A_S and B_S_PER_BYTE."""
  d = root / "traces" / "googlenet-caffe-k80"
  d.mkdir(parents=True)
  counts = [-(-n // 64) * 64 for _, w, b in _traces._googlenet_layers() for n in (w, b)]
  bwd = rng.uniform(500, 5000, size=64)

  def line(vals):
    return "I0101 00:00:00.000000 1 distributed.cpp:1] [" + ", ".join(vals) + "]\n"

  # 8 nodes, 5 columns: a layer's weight and bias in one all-reduce, logged on the weight row, twice
  rows8 = []
  for i, n in enumerate(counts):
    if i % 2:
      rows8.append([i, n, bwd[i // 2], 0.0, 0.0])
    else:
      t = (A_S + B_S_PER_BYTE * 4 * (n + counts[i + 1])) * 1e6 * rng.normal(1, 0.02, size=2)
      rows8.append([i, n, bwd[i // 2], t[0], t[1]])
  zeros = [[i, n, 0.0, 0.0, 0.0] for i, n in enumerate(counts)]
  (d / "tmp8comm.log").write_text("".join(line([f"{v:.10g}" for v in r]) for r in zeros + rows8))
  # 2 nodes, 4 columns: each row its own all-reduce (a + b/2 at P=2 for the same alpha, beta)
  rows2 = [[i, n, bwd[i // 2], (A_S / 7 + B_S_PER_BYTE * 8 / 14 * 4 * n) * 1e6] for i, n in enumerate(counts)]
  (d / "tmp2comm.log").write_text("".join(line([f"{v:.10g}" for v in r]) for r in rows2))
  # a merged run: groups of 4 rows, each logged on its first row
  rows_o = [[i, n, bwd[i // 2], 1.0, 1234.0 if i % 4 == 0 else 0.0] for i, n in enumerate(counts)]
  (d / "tmp8ocomm.log").write_text("".join(line([f"{v:.10g}" for v in r]) for r in rows_o))
  return counts


def test_googlenet_network_on_a_synthetic_trace_with_known_alpha_and_beta(tmp_path):
  counts = _write_logs(tmp_path, np.random.default_rng(1))
  sizes, secs = googlenet_layer_allreduce(8, shared_dir=tmp_path)
  assert sizes.shape == (64,) and secs.shape == (64, 2)                  # weight + bias per message
  assert sizes[0] == 4 * (counts[0] + counts[1]) and sizes.sum() == 4 * sum(counts)
  m = googlenet_network(8, shared_dir=tmp_path)
  assert m.name == "googlenet-k80-fit8" and m.workers == 8
  assert m.startup_s == pytest.approx(A_S, rel=0.1) and m.per_byte_s == pytest.approx(B_S_PER_BYTE, rel=0.02)
  # the same link seen by 2 workers: alpha and beta agree with the 8-node fit
  m2 = googlenet_network(2, shared_dir=tmp_path)
  assert googlenet_layer_allreduce(2, shared_dir=tmp_path)[1].shape == (128, 1)
  assert m2.alpha_s == pytest.approx(m.alpha_s, rel=0.1) and m2.beta_s_per_byte == pytest.approx(
      m.beta_s_per_byte, rel=0.03)
  groups, secs = googlenet_merged_groups(8, shared_dir=tmp_path)
  assert groups[:2] == ((0, 1, 2, 3), (4, 5, 6, 7)) and len(groups) == 32 and np.allclose(secs, 1234e-6)


def test_a_missing_trace_says_so(tmp_path):
  for call in (lambda: googlenet_network(8, shared_dir=tmp_path),
               lambda: googlenet_layer_allreduce(4, shared_dir=tmp_path),
               lambda: googlenet_merged_groups(8, shared_dir=tmp_path)):
    with pytest.raises(TraceUnavailableError, match=f"not on this machine.*{tmp_path}.*shared_dir="):
      call()
  _write_logs(tmp_path, np.random.default_rng(2))   # has tmp8comm.log, lacks tmp4comm.log
  with pytest.raises(TraceUnavailableError, match="tmp4comm.log is not on this machine"):
    googlenet_network(4, shared_dir=tmp_path)
  with pytest.raises(ValueError, match=r"nodes=2.*\[4, 8\]"):
    googlenet_merged_groups(2, shared_dir=tmp_path)
  with pytest.raises(ValueError, match=r"nodes=3"):
    googlenet_network(3, shared_dir=tmp_path)


@needs_googlenet
def test_googlenet_network_from_the_real_run():
  sizes, secs = googlenet_layer_allreduce(8)
  assert sizes.shape == (65,) and secs.shape == (65, 2) and sizes.sum() == 4 * 13_379_136
  for nodes in (2, 4, 8):
    m = googlenet_network(nodes)   # raises if the fitted link beats 10 Gbit/s
    assert 1 / m.beta_s_per_byte < 0.7e9 and 0.5e-3 < m.startup_s < 3e-3, (nodes, m)
  m8 = googlenet_network(8)
  # the run's all-reduces start slower than the OSU test's (host copies, GPU synchronisation)
  osu = NetworkModel.fit(*_traces.googlenet_allreduce(8, min_bytes=_traces.ALGORITHM_SWITCH_BYTES), workers=8)
  assert m8.startup_s > 1.5 * osu.startup_s
  # and that start-up cost is what merging saves: mgwfbp well ahead of wfbp at 8 nodes
  prof = load_trace("googlenet-k80", nodes=8)
  t = {k: simulate(plan(prof, m8, k), prof, m8).iteration_s for k in ("wfbp", "mgwfbp")}
  assert t["wfbp"] / t["mgwfbp"] > 1.2, t


@needs_googlenet
def test_the_authors_merged_run_is_a_size_threshold_merge_and_the_fit_predicts_its_times():
  groups, secs = googlenet_merged_groups(8)
  assert len(groups) == 30 and sum(len(g) for g in groups) == 128
  counts = [4 * (-(-int(np.prod(r.shape)) // 64) * 64) for r in load_trace("googlenet-k80").rows]
  # B-Caffe's GetReduceBucketId: going backward, flush once more than 131,072 elements (512 KiB) are
  # queued; every boundary but one (row 37, a bias B-Caffe reduces alone in both runs) is that rule's
  starts, queued = set(), 0
  for r in range(127, -1, -1):
    queued += counts[r]
    if queued > 4 * 131_072 or r == 0:
      starts.add(r)
      queued = 0
  assert {g[0] for g in groups} - starts == {37} and starts <= {g[0] for g in groups}
  # the fit from the unmerged run predicts the merged all-reduces it never saw
  m8 = googlenet_network(8)
  pred = np.array([m8.allreduce_s(sum(counts[r] for r in g)) for g in groups])
  assert np.median(np.abs(pred / secs - 1)) < 0.15
