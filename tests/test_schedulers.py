"""The scheduling policies: a conformance suite every policy passes, plus each policy's own rule.

Pure: these tests never import jax.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from prophet_jax import Bucket, Chunk, GradientProfile, NetworkModel, Schedule
from prophet_jax._values._types import itemsize
from prophet_jax.schedulers import Scheduler, bucket, dear, dlcp, mgwfbp, priority, prophet, wfbp, xla
from prophet_jax.schedulers import _bucket as bucket_mod
from prophet_jax.schedulers import _common
from prophet_jax.schedulers import _priority as priority_mod
from prophet_jax.schedulers._mgwfbp import merge_groups
from prophet_jax.schedulers._prophet import find_stages

from prophet_jax import models
from prophet_jax._planning._simulate import simulate
from prophet_jax.schedulers import _auto as auto_mod


def profile(rows, *, forward_s=0.01, backward_s=None):
  """rows: (layer, shape, dtype, ready_s[, update_s]) in priority order; paths '<layer>/p<i>'."""
  out = []
  for i, row in enumerate(rows):
    layer, shape, dtype, ready = row[:4]
    n = int(np.prod(shape, dtype=np.int64))
    out.append(dict(path=f"{layer}/p{i}", layer=layer, shape=tuple(shape), dtype=dtype,
                    nbytes=n * itemsize(dtype), ready_s=ready, update_s=row[4] if len(row) > 4 else 0.0))
  bwd = max(r["ready_s"] for r in out) if backward_s is None else backward_s
  return GradientProfile.from_rows(out, forward_s=forward_s, backward_s=bwd)


def layered(sizes, *, backward_s=0.1, forward_s=0.05, dtype="float32"):
  """One row per layer, sizes in elements in forward order; ready back to front, in proportion to size."""
  total = max(sum(sizes), 1)
  ready, t = [0.0] * len(sizes), 0.0
  for i in reversed(range(len(sizes))):
    t += backward_s * sizes[i] / total
    ready[i] = min(t, backward_s)
  rows = [dict(path=f"l{i:04d}/w", layer=f"l{i:04d}", shape=(n,), dtype=dtype, nbytes=n * itemsize(dtype),
               ready_s=ready[i], fwd_s=forward_s * n / total) for i, n in enumerate(sizes)]
  return GradientProfile.from_rows(rows, forward_s=sum(r["fwd_s"] for r in rows), backward_s=backward_s)


def _random_profile():
  rng = np.random.default_rng(0)
  rows = []
  for i in range(24):
    shape = (int(rng.integers(1, 5000)),) if i % 3 else (int(rng.integers(1, 64)), int(rng.integers(1, 64)))
    rows.append((f"L{i // 2}", shape, "float32", float(rng.uniform(0, 0.05))))
  return profile(rows, backward_s=0.05)


PROFILES = {
    "random": _random_profile(),
    "multi_dtype": profile([("a", (300,), "float32", 0.03), ("a", (100,), "bfloat16", 0.03),
                            ("b", (2000,), "float16", 0.02), ("b", (50,), "float32", 0.021),
                            ("c", (4096,), "bfloat16", 0.01), ("d", (7,), "float64", 0.0)]),
    "zero_size": profile([("a", (0,), "float32", 0.02), ("a", (10,), "float32", 0.02),
                          ("b", (3, 0), "float32", 0.01), ("c", (0,), "bfloat16", 0.005),
                          ("c", (5, 5), "float32", 0.004)]),
    "all_zero": profile([("a", (0,), "float32", 0.01), ("b", (2, 0), "float32", 0.0)]),
    "single": profile([("only", (1000,), "float32", 0.01)]),
    "large": profile([("emb", (12_000_000,), "float32", 0.09), ("mid", (10,), "float32", 0.05),
                      ("head", (9_000_000,), "bfloat16", 0.02), ("out", (5_000_000,), "float32", 0.0)]),
}
NETWORKS = {
    "10gbe_p8": NetworkModel.preset("10gbe", workers=8),
    "cpu_p4": NetworkModel.preset("1gbe", workers=4, overlap=False),
}
FACTORIES = {"wfbp": wfbp, "bucket": bucket, "xla": xla, "mgwfbp": mgwfbp, "priority": priority,
             "prophet": prophet, "bucket[horovod]": functools.partial(bucket, style="horovod"),
             "priority[allreduce]": functools.partial(priority, mode="allreduce"),
             "dlcp[0.25]": functools.partial(dlcp, max_defer=0.25), "dear": dear,
             "dear[25MiB]": functools.partial(dear, bucket_bytes=25 * 2**20)}


def assert_covers_exactly_once(s: Schedule, p: GradientProfile) -> None:
  """Every element of every non-empty row in exactly one chunk, checked independently of Schedule.

  Deferral groups (`Bucket.defer`) hold their elements in their chunks like any bucket; what they
  add is checked here too: at most half of a group waits, one dtype per group.
  """
  for b in s.buckets:
    assert 0 <= 2 * b.defer <= len(b.chunks), f"a bucket of {len(b.chunks)} chunks defers {b.defer}"
    assert not b.defer or len({c.dtype for c in b.chunks}) == 1, "a deferral group mixes dtypes"
  edges = [[] for _ in p.rows]   # +1 at each slice start, -1 at each stop: coverage by a sweep
  for k, c in enumerate(s.chunks):
    assert len({p.rows[r].dtype for r, _, _ in c.slices}) == 1, f"chunk{k} mixes dtypes"
    for r, a, b in c.slices:
      assert p.rows[r].dtype == c.dtype, f"chunk{k} dtype {c.dtype} holds {p.rows[r].path}"
      assert 0 <= a < b <= p.rows[r].size, f"chunk{k} slice {(r, a, b)} out of range"
      edges[r] += [(a, 1), (b, -1)]
  for row, ev in zip(p.rows, edges):
    depth, pos, covered = 0, 0, 0
    for x, d in sorted(ev, key=lambda e: (e[0], e[1])):   # stops before starts at the same point
      if depth:
        assert depth == 1, f"{row.path}: elements [{pos}:{x}] sent {depth} times"
        covered += x - pos
      depth, pos = depth + d, x
    assert covered == row.size, f"{row.path}: {covered} of {row.size} elements sent"


@pytest.mark.parametrize("net", sorted(NETWORKS))
@pytest.mark.parametrize("prof", sorted(PROFILES))
@pytest.mark.parametrize("cross_step", [False, True])
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_conformance(name, cross_step, prof, net):
  p, n = PROFILES[prof], NETWORKS[net]
  sched = FACTORIES[name]()
  assert isinstance(sched, Scheduler)
  s = sched(p, n, cross_step=cross_step)
  assert isinstance(s, Schedule)
  assert s.policy == name.split("[")[0] and s.cross_step is cross_step
  assert s.tree_fingerprint == p.fingerprint() and s.rows == p.tree_rows()
  assert_covers_exactly_once(s, p)
  again = FACTORIES[name]()(p, n, cross_step=cross_step)
  assert again == s and hash(again) == hash(s)           # deterministic and hashable
  assert Schedule.from_json(s.to_json()) == s             # JSON round trip
  if prof == "all_zero":
    assert s.num_allreduces == 0
  if name.startswith("dear"):        # sharded: every chunk (a reduce-scatter) in one all-gather
    assert s.sharded == (prof != "all_zero")
    assert sorted(k for g in s.gathers for k in g) == list(range(len(s.chunks) if s.sharded else 0))
    assert simulate(s, p, n, cross_step=cross_step).iteration_s == pytest.approx(s.predicted_s, rel=1e-9)


def test_conformance_auto():
  n = NETWORKS["10gbe_p8"]
  for prof in ("multi_dtype", "zero_size", "single"):
    p = PROFILES[prof]
    for cs in (False, True):
      s = auto_mod.auto()(p, n, cross_step=cs)
      assert_covers_exactly_once(s, p)
      assert Schedule.from_json(s.to_json()) == s


@pytest.mark.parametrize("net", [NetworkModel(alpha_s=0.0, beta_s_per_byte=0.0, workers=1),
                                 NetworkModel(alpha_s=0.0, beta_s_per_byte=1e-9, workers=8),
                                 NetworkModel(alpha_s=1e-4, beta_s_per_byte=0.0, workers=8)],
                         ids=["one_worker", "no_alpha", "no_beta"])
def test_every_policy_plans_on_degenerate_networks(net):
  for prof in ("random", "large", "zero_size"):
    p = PROFILES[prof]
    for name, factory in FACTORIES.items():
      for cs in (False, True):
        s = factory()(p, net, cross_step=cs)
        assert_covers_exactly_once(s, p)
        assert s.num_allreduces <= 4 * sum(1 for r in p.rows if r.nbytes) + 600, name


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_schedulers_reject_bad_inputs(name):
  sched = FACTORIES[name]()
  p, n = PROFILES["single"], NETWORKS["10gbe_p8"]
  with pytest.raises(TypeError, match="cross_step"):
    sched(p, n, cross_step="auto")
  with pytest.raises(TypeError, match="GradientProfile"):
    sched(p.to_dict(), n, cross_step=False)
  with pytest.raises(TypeError, match="NetworkModel"):
    sched(p, "10gbe", cross_step=False)


@pytest.mark.parametrize("call, exc, match", [
    (lambda: bucket(bucket_bytes=0), ValueError, r"bucket\(bucket_bytes=0\).*positive"),
    (lambda: bucket(bucket_bytes=-5), ValueError, "bucket_bytes"),
    (lambda: bucket(bucket_bytes=1.5), TypeError, "integer number of bytes"),
    (lambda: bucket(bucket_bytes="25MiB"), TypeError, "bucket_bytes"),
    (lambda: bucket(style="DDP"), ValueError, r"bucket\(style='DDP'\).*'ddp', 'horovod'"),
    (lambda: bucket(style="ddp", cycle_s=1e-3), ValueError, "cycle_s.*Horovod"),
    (lambda: bucket(style="horovod", first_bucket_bytes=2**20), ValueError, "no first bucket"),
    (lambda: bucket(style="horovod", cycle_s=-1e-3), ValueError, r"cycle_s=-0.001.*>= 0"),
    (lambda: bucket(style="horovod", cycle_s="5ms"), TypeError, "cycle_s"),
    (lambda: priority(mode="all-reduce"), ValueError, r"mode='all-reduce'.*\['allreduce', 'ps'\]"),
    (lambda: bucket(first_bucket_bytes=0), ValueError, "first_bucket_bytes"),
    (lambda: bucket(bucket_bytes=True), TypeError, "bucket_bytes"),
    (lambda: priority(partition_bytes=0), ValueError, "partition_bytes"),
    (lambda: priority(credit_bytes=-1), ValueError, "credit_bytes"),
    (lambda: priority(credit_bytes=math.inf), TypeError, "credit_bytes"),
    (lambda: prophet(gap_factor=0), ValueError, "gap_factor"),
    (lambda: prophet(alpha_fraction=-0.1), ValueError, "alpha_fraction"),
    (lambda: prophet(tail_growth=0.5), ValueError, "tail_growth.*>= 1"),
    (lambda: prophet(gap_factor="2"), TypeError, "gap_factor"),
    (lambda: wfbp(bucket_bytes=1), TypeError, "bucket_bytes"),
])
def test_bad_options_raise_clearly(call, exc, match):
  with pytest.raises(exc, match=match):
    call()


def test_priority_rejects_absurd_partition_counts():
  p = PROFILES["large"]
  with pytest.raises(ValueError, match="partition_bytes"):
    priority(partition_bytes=4)(p, NETWORKS["10gbe_p8"], cross_step=True)


# --------------------------------------------------------------------------------------------------
# Helpers of _common (used by auto too)


def test_partition_row_is_balanced_and_respects_the_limit():
  p = profile([("a", (10,), "float32", 0.0), ("b", (0,), "float32", 0.0), ("c", (3,), "float64", 0.0)])
  assert _common.partition_row(p, 0, 12) == [(0, 0, 3), (0, 3, 6), (0, 6, 8), (0, 8, 10)]
  assert _common.partition_row(p, 0, None) == [(0, 0, 10)]
  assert _common.partition_row(p, 0, 1) == [(0, k, k + 1) for k in range(10)]  # < one element: 1 each
  assert _common.partition_row(p, 1, 12) == []
  assert _common.partition_row(p, 2, 16) == [(2, 0, 2), (2, 2, 3)]


def test_buckets_from_groups_splits_by_dtype_and_drops_empty():
  p = PROFILES["multi_dtype"]
  (b,) = _common.buckets_from_groups(p, [[(0, 0, 300), (1, 0, 100), (3, 0, 50)], []])
  assert [c.dtype for c in b.chunks] == ["float32", "bfloat16"]
  assert b.chunks[0].slices == ((0, 0, 300), (3, 0, 50))


# --------------------------------------------------------------------------------------------------
# wfbp, bucket, xla


def test_wfbp_one_allreduce_per_layer_in_ready_order_one_chunk_per_dtype():
  p = PROFILES["multi_dtype"]
  s = wfbp()(p, NETWORKS["10gbe_p8"], cross_step=False)
  # layers ready: d 0.0, c 0.01, b 0.021 (its last row), a 0.03
  firsts = [p.rows[b.chunks[0].slices[0][0]].layer for b in s.buckets]
  assert firsts == ["d", "c", "b", "a"]
  assert [len(b.chunks) for b in s.buckets] == [1, 1, 2, 2]
  assert s.num_allreduces == 6


def _groups(s: Schedule) -> list[list[int]]:
  return [[r for c in b.chunks for r, _, _ in c.slices] for b in s.buckets]


def test_bucket_ddp_closes_once_the_cap_is_reached_and_horovod_before_it_overflows():
  p = layered([100, 300, 50, 50, 1000, 20])   # float32: bytes 400, 1200, 200, 200, 4000, 80
  net = NETWORKS["10gbe_p8"]
  # ready order 5, 4, 3, 2, 1, 0. DDP: row 5 (80 B) is under the first cap (300 B); row 4 (4000 B)
  # joins it and the bucket, now past its cap, closes (it overshoots); then 3, 2 (400 B) stay under
  # 1000 B and row 1 (1200 B) joins and closes it; row 0 is left open and goes last.
  ddp = bucket(bucket_bytes=1000, first_bucket_bytes=300)(p, net, cross_step=False)
  assert _groups(ddp) == [[5, 4], [3, 2, 1], [0]]
  # Horovod (one cycle holds every row): a row that would overflow 1000 B closes the buffer first, and
  # a row larger than the threshold goes alone.
  hvd = bucket(style="horovod", bucket_bytes=1000, cycle_s=1.0)(p, net, cross_step=False)
  assert _groups(hvd) == [[5], [4], [3, 2], [1], [0]]


def test_bucket_ddp_first_bucket_cap_follows_ddp():
  p = layered([2**17] * 10)   # ten rows of 512 KiB (5 MiB)
  net = NETWORKS["10gbe_p8"]
  # caps left at DDP's defaults: a 1 MiB first bucket (two rows), then 25 MiB (the rest)
  s = bucket()(p, net, cross_step=False)
  assert [len(g) for g in _groups(s)] == [2, 8]
  assert dict(s.options) == {"style": "ddp", "bucket_bytes": 25 * 2**20, "first_bucket_bytes": 2**20,
                             "cycle_s": None}
  # an explicit cap sets the first bucket's cap too (bucket_cap_mb=25 on a 5 MiB model: one bucket)
  s = bucket(bucket_bytes=25 * 2**20)(p, net, cross_step=False)
  assert [len(g) for g in _groups(s)] == [10] and dict(s.options)["first_bucket_bytes"] == 25 * 2**20
  s = bucket(bucket_bytes=2 * 2**20)(p, net, cross_step=False)
  assert [len(g) for g in _groups(s)] == [4, 4, 2]
  # an explicit first cap wins; the recorded options plan the same buckets again
  s = bucket(bucket_bytes=2 * 2**20, first_bucket_bytes=2**19)(p, net, cross_step=False)
  assert [len(g) for g in _groups(s)] == [1, 4, 4, 1]
  assert bucket(**dict(s.options))(p, net, cross_step=False) == s
  # Horovod: 64 MiB by default, no first bucket: one buffer when every row is ready in one cycle
  h = bucket(style="horovod", cycle_s=1.0)(p, net, cross_step=False)
  assert [len(g) for g in _groups(h)] == [10] and dict(h.options)["bucket_bytes"] == 64 * 2**20


def test_bucket_ddp_keeps_one_bucket_per_dtype_each_with_its_first_cap():
  p = profile([("a", (100,), "float32", 0.5), ("b", (100,), "bfloat16", 0.4), ("c", (100,), "float32", 0.3),
               ("d", (100,), "bfloat16", 0.2), ("e", (100,), "float32", 0.1)])
  # ready order e, d, c, b, a; caps 400 B (first) then 1000 B, per dtype. float32 (400 B a row): e
  # reaches the first cap alone; c, a stay open (800 B). bfloat16 (200 B a row): d, b reach 400 B.
  s = bucket(bucket_bytes=1000, first_bucket_bytes=400)(p, NETWORKS["10gbe_p8"], cross_step=False)
  assert _groups(s) == [[4], [3, 1], [2, 0]]
  assert all(len(b.chunks) == 1 for b in s.buckets)   # one dtype per bucket, as DDP


def test_bucket_horovod_fuses_per_cycle_and_looks_past_other_dtypes():
  rows = [("a", (25,), "float32", 0.007), ("b", (25,), "float32", 0.006), ("c", (25,), "float32", 0.002),
          ("d", (25,), "float32", 0.001)]
  p, net = profile(rows), NETWORKS["10gbe_p8"]
  # 5 ms cycles: d, c are fused at the 5 ms tick, b, a at the 10 ms one; a zero cycle fuses nothing
  assert _groups(bucket(style="horovod", cycle_s=5e-3)(p, net, cross_step=False)) == [[3, 2], [1, 0]]
  assert _groups(bucket(style="horovod", cycle_s=0)(p, net, cross_step=False)) == [[3], [2], [1], [0]]
  # one cycle: a bfloat16 row between float32 rows is looked past (FuseResponses), then fused apart
  mixed = profile([("a", (25,), "float32", 0.003), ("b", (50,), "bfloat16", 0.002),
                   ("c", (25,), "float32", 0.001)])
  assert _groups(bucket(style="horovod", cycle_s=1.0)(mixed, net, cross_step=False)) == [[2, 0], [1]]
  # ... but only while the skipped bytes plus the fused ones fit the threshold (100 + 100 > 150 B)
  assert _groups(bucket(style="horovod", cycle_s=1.0, bucket_bytes=150)(mixed, net, cross_step=False)) \
      == [[2], [1], [0]]


@settings(deadline=None, max_examples=40, derandomize=True)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=30), st.integers(64, 8000),
       st.sampled_from([None, 1e-3, 1.0]))
def test_bucket_horovod_stays_within_threshold_unless_one_leaf_is_larger(sizes, threshold, cycle_s):
  p = layered(sizes)
  s = bucket(style="horovod", bucket_bytes=threshold, cycle_s=cycle_s)(p, NETWORKS["10gbe_p8"],
                                                                      cross_step=False)
  assert_covers_exactly_once(s, p)
  for b in s.buckets:
    nbytes = sum(c.nbytes for c in b.chunks)
    assert nbytes <= threshold or sum(len(c.slices) for c in b.chunks) == 1


@settings(deadline=None, max_examples=40, derandomize=True)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=30), st.integers(64, 8000), st.integers(64, 8000))
def test_bucket_ddp_closes_exactly_when_the_cap_is_reached(sizes, threshold, first):
  p = layered(sizes)
  s = bucket(bucket_bytes=threshold, first_bucket_bytes=first)(p, NETWORKS["10gbe_p8"], cross_step=False)
  assert_covers_exactly_once(s, p)
  order = [r for r in p.ready_order() if p.rows[r].nbytes]
  assert [r for g in _groups(s) for r in g] == order   # buckets are runs of the ready order
  for k, g in enumerate(_groups(s)):
    cap = first if k == 0 else threshold
    nbytes = [p.rows[r].nbytes for r in g]
    assert sum(nbytes[:-1]) < cap                      # it had not reached the cap before its last leaf
    assert sum(nbytes) >= cap or k == len(s.buckets) - 1   # and only the last bucket closes under it


def test_xla_one_combined_allreduce_per_dtype_without_overlap_and_30mib_with():
  p = PROFILES["large"]
  cpu = xla()(p, NETWORKS["cpu_p4"], cross_step=False)
  assert len(cpu.buckets) == 1 and sorted(c.dtype for c in cpu.chunks) == ["bfloat16", "float32"]
  gpu = xla()(p, NETWORKS["10gbe_p8"], cross_step=False)
  # ready order out(20 MB), head(18 MB), mid(40 B), emb(48 MB): out alone (with head it passes 30
  # MiB), head + mid, emb alone
  assert [[r for c in b.chunks for r, _, _ in c.slices] for b in gpu.buckets] == [[3], [2, 1], [0]]


# --------------------------------------------------------------------------------------------------
# mgwfbp: hand-computed cases. Network: workers=2, alpha_s=0.5 -> a = 2(P-1)alpha = 1 s;
# beta=0.001 -> b = 2(P-1)/P beta = 0.001 s/B.

HAND = NetworkModel(alpha_s=0.5, beta_s_per_byte=0.001, workers=2)


def _mg_runs(ready, nbytes):
  return merge_groups(ready, [{"float32": n} for n in nbytes], HAND)


def test_mgwfbp_hand_case_merge_when_started_less_than_a_before():
  # u0 ready 1.0, 1000 B: t_c = 1 + 1 = 2, tau_c(0) = 1.0, runs until 3.0.
  # u1 ready 1.5 < 3.0 (still running) and 1.5 - 1.0 = 0.5 < a = 1 -> merge u0 into u1:
  #   u1 holds 1500 B, t_c = 2.5, tau_c(1) = max(1.0 + 0, 1.5) = 1.5, runs until 4.0.
  # u2 ready 5.0 >= 4.0 (finished) -> no merge.
  assert _mg_runs([1.0, 1.5, 5.0], [1000, 500, 1000]) == [[0, 1], [2]]


def test_mgwfbp_hand_case_no_merge_when_started_long_before_but_merge_when_not_started():
  # u0 ready 0, 1000 B: runs 0 -> 2. u1 ready 1.5: still running, but 1.5 - 0 = 1.5 >= a -> no merge.
  # u1 (500 B, t_c 1.5): tau_c(1) = max(0 + 2, 1.5) = 2.0 -> runs 2.0 -> 3.5.
  # u2 ready 1.6 < 3.5 and tau_c(1) = 2.0 > 1.6 (not started yet) -> merge u1 into u2.
  assert _mg_runs([0.0, 1.5, 1.6], [1000, 500, 1000]) == [[0], [1, 2]]


def test_mgwfbp_hand_case_no_merge_when_finished():
  # u0 runs 0 -> 2; u1 ready 3.0 after it ended -> no merge; u1 runs 3 -> 5; u2 ready 5.0 -> no merge.
  assert _mg_runs([0.0, 3.0, 5.0], [1000, 1000, 10]) == [[0], [1], [2]]


def test_mgwfbp_hand_case_chained_merges_recompute_tc():
  # Three tiny layers close together: u0 (10 B, t_c 1.01) at 0.0; u1 at 0.1: 0.1 - 0 < 1 -> merge
  # (u1: 20 B, t_c 1.02, tau_c = 0.1, ends 1.12); u2 at 0.2 < 1.12, 0.2 - 0.1 < 1 -> merge: one group.
  assert _mg_runs([0.0, 0.1, 0.2], [10, 10, 10]) == [[0, 1, 2]]


def test_mgwfbp_uses_layers_in_ready_order():
  rows = [("a", (250,), "float32", 1.5), ("b", (250,), "float32", 1.0), ("b", (0,), "float32", 0.2),
          ("c", (250,), "float32", 5.0)]
  # layers in ready order: b (1.0, 1000 B), a (1.5, 1000 B), c (5.0): b merges into a (0.5 < a).
  s = mgwfbp()(profile(rows, backward_s=5.0), HAND, cross_step=False)
  assert [[r for r, _, _ in c.slices] for c in s.chunks] == [[1, 0], [3]]


@settings(deadline=None, max_examples=40, derandomize=True)
@given(st.lists(st.tuples(st.integers(1, 5000), st.floats(0.0, 1.0)), min_size=1, max_size=8),
       st.floats(1e-5, 1e-2), st.floats(1e-10, 1e-7))
def test_mgwfbp_never_slower_than_wfbp_or_one_bucket(layers, alpha, beta):
  ready = sorted((t for _, t in layers), reverse=True)   # forward order, ready back to front
  p = profile([(f"l{i}", (n,), "float32", r) for i, ((n, _), r) in enumerate(zip(layers, ready))])
  net = NetworkModel(alpha_s=alpha, beta_s_per_byte=beta, workers=4)
  t = {name: simulate(f()(p, net, cross_step=False), p, net).iteration_s
       for name, f in (("mgwfbp", mgwfbp), ("wfbp", wfbp))}
  one = simulate(bucket(bucket_bytes=2**40)(p, net, cross_step=False), p, net).iteration_s
  assert t["mgwfbp"] <= min(t["wfbp"], one) * (1 + 1e-9) + 1e-12


# --------------------------------------------------------------------------------------------------
# priority (ByteScheduler)


def test_priority_defaults_are_bytescheduler_s_per_mode():
  p = profile([("a", (3_000_000,), "float32", 0.1), ("b", (1_000_003,), "bfloat16", 0.0),
               ("c", (9_000_000,), "float32", 0.0)])
  net = NETWORKS["10gbe_p8"]
  s = priority()(p, net, cross_step=True)
  # "ps" (ByteScheduler's code defaults): parts of at most 1,000,000 parameters, as equal as possible
  sizes = {r: sorted(c.size for c in s.chunks if c.slices[0][0] == r) for r in range(3)}
  assert sizes == {0: [1_000_000] * 3, 1: [500_001, 500_002], 2: [1_000_000] * 9}
  assert all(len(c.slices) == 1 for c in s.chunks)     # it never fuses tensors
  assert all(len(b.chunks) == 1 for b in s.buckets)    # one all-reduce per partition
  assert dict(s.options) == {"partition_bytes": None, "credit_bytes": None, "mode": "ps"}
  # "allreduce" (its documented all-reduce values): 8,000,000-parameter parts
  s = priority(mode="allreduce")(p, net, cross_step=True)
  sizes = {r: sorted(c.size for c in s.chunks if c.slices[0][0] == r) for r in range(3)}
  assert sizes == {0: [3_000_000], 1: [1_000_003], 2: [4_500_000] * 2}
  assert priority_mod.MODE_DEFAULTS == {"ps": (1_000_000, 4_000_000), "allreduce": (8_000_000, 16_000_000)}


def test_priority_default_credit_counts_parameters():
  # float16 parts of 1,000,000 parameters (2 MB). The default window, 4,000,000 parameters, lets four
  # go at t=0; a high-priority row ready at 0.5 s goes when the first ends. The same number given in
  # bytes (credit_bytes=16,000,000, i.e. 4M float32 parameters) lets all eight float16 parts go first.
  p = profile([("hi", (10,), "float16", 0.5), ("lo", (8_000_000,), "float16", 0.0)])
  s = priority()(p, HAND, cross_step=True)
  assert [c.slices[0][0] for c in s.chunks][:6] == [1, 1, 1, 1, 0, 1]
  s = priority(credit_bytes=16_000_000)(p, HAND, cross_step=True)   # the same window in bytes: 8 parts
  assert [c.slices[0][0] for c in s.chunks][:9] == [1] * 8 + [0]


def test_priority_credit_delays_a_late_high_priority_partition_behind_the_window():
  # a=1 s, b=0.001 s/B. Row 1 (low priority, 4000 B) ready at 0 -> 4 partitions of 1000 B (2 s each);
  # row 0 (high priority, 1000 B) ready at 0.5.
  p = profile([("hi", (250,), "float32", 0.5), ("lo", (1000,), "float32", 0.0)])
  # credit 2000 B: at t=0 two low partitions go (0-2, 2-4); at 0.5 row 0 is ready but the credit is
  # used; at 2.0 the first ends and row 0, the highest priority, is issued, then the other two low.
  s = priority(partition_bytes=1000, credit_bytes=2000)(p, HAND, cross_step=True)
  assert [c.slices[0] for c in s.chunks] == [(1, 0, 250), (1, 250, 500), (0, 0, 250), (1, 500, 750),
                                              (1, 750, 1000)]
  # an unbounded credit commits every low partition at t=0: the high one goes last.
  s = priority(partition_bytes=1000, credit_bytes=10**9)(p, HAND, cross_step=True)
  assert s.chunks[-1].slices == ((0, 0, 250),)


def test_priority_issues_while_credit_remains_and_may_overshoot_the_window():
  # ByteCore._loop waits only once the remaining credit is <= 0. Credit 1500 B, parts 1000 B: at t=0
  # two low parts go (1000 < 1500, then 2000); row 0 (ready at 0.5) waits for the first to end at 2.0
  # (in flight 1000 < 1500) and goes; then the last two low parts. (A rule that waits until the next
  # part fits would send one low part, then row 0 at 2.0, then the others.)
  p = profile([("hi", (250,), "float32", 0.5), ("lo", (1000,), "float32", 0.0)])
  s = priority(partition_bytes=1000, credit_bytes=1500)(p, HAND, cross_step=True)
  assert [c.slices[0] for c in s.chunks] == [(1, 0, 250), (1, 250, 500), (0, 0, 250), (1, 500, 750),
                                              (1, 750, 1000)]


def test_bucket_and_priority_docstring_examples():
  import doctest

  for mod in (bucket_mod, priority_mod):
    res = doctest.testmod(mod)
    assert res.attempted > 0 and res.failed == 0, mod.__name__


# --------------------------------------------------------------------------------------------------
# prophet


def test_find_stages_splits_at_large_gaps():
  assert find_stages([0.0, 0.01, 0.02, 0.5, 0.51, 1.0], 2.0) == [0.0, 0.5, 1.0]
  assert find_stages([0.0, 0.1, 0.2, 0.3], 2.0) == [0.0]
  assert find_stages([0.3], 2.0) == [0.3]


def test_prophet_sends_each_stage_as_a_block_in_the_gap():
  # Three stages (a = 1 s, b = 0.001 s/B, 1000 B per row): rows 3, 4 ready at 0.0/0.01, rows 1, 2 at
  # 5.0/5.01, row 0 at 10.0. The block floor a / (0.5 b) is 2000 B, so at 0.0 the link waits for row
  # 3 (row 4 alone would take 2 s, past the next arrival); at 0.01 it sends rows 3, 4 (3 s, within the
  # 4.99 s gap); at 5.01 rows 1, 2 likewise; after backward, row 0.
  p = profile([("a", (250,), "float32", 10.0), ("b", (250,), "float32", 5.01),
               ("c", (250,), "float32", 5.0), ("d", (250,), "float32", 0.01),
               ("e", (250,), "float32", 0.0)])
  s = prophet(alpha_fraction=0.5, tail_growth=1.0)(p, HAND, cross_step=True)
  assert [sorted(r for r, _, _ in c.slices) for c in s.chunks] == [[3, 4], [1, 2], [0]]


def test_prophet_stage_block_holds_the_highest_priority_that_fits_the_gap():
  # a = 1 s, b = 0.001 s/B, floor a / (0.5 b) = 2000 B. Rows d (1000 B) and e (800 B) are ready at 0;
  # c (1000 B) at 2.6 opens a new stage (gap_factor 0.5: gaps 2.6 and 7.4 exceed 0.5 * mean 5.0);
  # a at 10. At 0: 1800 B pending < floor, B*delta = (2.6 - 0 - 1) / 0.001 = 1600 B < 1800 B, so the
  # stage block is d (higher priority) and the first 600 B (150 elements) of e, ending at 2.6. At 2.6:
  # c and the rest of e (1200 B) fit before 10, so they go together; after backward, a.
  p = profile([("a", (250,), "float32", 10.0), ("c", (250,), "float32", 2.6),
               ("d", (250,), "float32", 0.0), ("e", (200,), "float32", 0.0)])
  s = prophet(gap_factor=0.5, alpha_fraction=0.5, tail_growth=1.0)(p, HAND, cross_step=True)
  assert [c.slices for c in s.chunks] == [((2, 0, 250), (3, 0, 150)), ((1, 0, 250), (3, 150, 200)),
                                          ((0, 0, 250),)]


def test_prophet_without_overlap_sends_one_block_per_dtype_in_priority_order():
  p = PROFILES["multi_dtype"]
  s = prophet()(p, NETWORKS["cpu_p4"], cross_step=True)
  assert len(s.buckets) == 1 and s.num_allreduces == 4
  assert s.chunks[0].slices[0][0] == 0


def test_prophet_blocks_amortise_the_startup_on_a_smooth_trace():
  p = layered([50_000] * 200, backward_s=0.2)     # 200 equal layers, evenly spaced: no stages
  net = NetworkModel.preset("10gbe", workers=64)
  s = prophet(alpha_fraction=0.1)(p, net, cross_step=True)
  floor = net.startup_s / (0.1 * net.per_byte_s)
  # every block sent during backward holds at least the floor (or everything left at that point)
  assert s.num_allreduces < 200 / 4
  assert max(s.chunk_nbytes()) >= 0.999 * min(floor, p.total_nbytes)


def _resnet_like():
  """161 rows shaped like ResNet-50's gradient sizes (float32), ready back to front."""
  rng = np.random.default_rng(1)
  sizes = [9408]
  for stage, (width, blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)]):
    for b in range(blocks):
      sizes += [width * width * (4 if b else 1), width, width, width * width * 9, width, width,
                width * 4 * width, width * 4, width * 4]
  sizes += [2048 * 1000, 1000]
  sizes += [int(x) for x in rng.integers(64, 4096, size=161 - len(sizes))]
  return layered(sizes[:161], backward_s=0.13, forward_s=0.065)


@pytest.mark.parametrize("workers", [16, 256])
def test_prophet_beats_priority_in_the_pipelined_step_on_a_balanced_resnet_like_profile(workers):
  p = _resnet_like()
  net = NetworkModel.preset("10gbe", workers=workers)
  t_pro = simulate(prophet()(p, net, cross_step=True), p, net, cross_step=True).iteration_s
  t_pri = simulate(priority()(p, net, cross_step=True), p, net, cross_step=True).iteration_s
  assert t_pro * 1.05 < t_pri, (t_pro, t_pri)


def test_the_coverage_check_itself_catches_repeats_and_drops():
  p = PROFILES["single"]
  good = wfbp()(p, NETWORKS["10gbe_p8"], cross_step=False)
  for slices, match in ((((0, 0, 600), (0, 500, 1000)), r"\[500:600\] sent 2 times"),
                        (((0, 0, 500), (0, 600, 1000)), "900 of 1000 elements sent")):
    bad = object.__new__(Schedule)   # bypasses Schedule's own check, to test ours
    for f in ("rows", "tree_fingerprint", "policy", "options", "cross_step", "predicted_s", "schema"):
      object.__setattr__(bad, f, getattr(good, f))
    object.__setattr__(bad, "buckets", (Bucket(chunks=(Chunk(slices=slices, dtype="float32"),)),))
    with pytest.raises(AssertionError, match=match):
      assert_covers_exactly_once(bad, p)


@pytest.mark.parametrize("trace, net, workers", [("resnet50-h100", "100gb-ib", 64),
                                                 ("bert-base-v100", "25gbe", 64),
                                                 ("gpt2-v100", "10gbe", 256)])
def test_prophet_beats_priority_on_balanced_bundled_traces(trace, net, workers):
  p = models.load_trace(trace)  # bundled with the package: a failure to load is a failure
  n = NetworkModel.preset(net, workers=workers)
  assert 0.7 <= n.allreduce_s(p.total_nbytes) / (p.forward_s + p.backward_s) <= 1.5   # a balanced cell
  t_pro = simulate(prophet()(p, n, cross_step=True), p, n, cross_step=True).iteration_s
  t_pri = simulate(priority()(p, n, cross_step=True), p, n, cross_step=True).iteration_s
  assert t_pro * 1.2 <= t_pri, (t_pro, t_pri)


def _sharded(p: GradientProfile, workers: int) -> GradientProfile:
  """`p` with every row whose first dimension divides by `workers` sharded on it, the rest replicated."""
  import dataclasses

  rows = tuple(dataclasses.replace(r, shard_dim=0 if r.shape and r.shape[0] and r.shape[0] % workers == 0
                                   else None) for r in p.rows)
  return dataclasses.replace(p, rows=rows, mesh=(("data", workers),), shard_axes=("data",))


@pytest.mark.parametrize("net", sorted(NETWORKS))
@pytest.mark.parametrize("prof", ["random", "multi_dtype", "large"])
def test_conformance_fsdp(prof, net):
  """fsdp as the others: every element in exactly one chunk, deterministic, JSON, its prediction
  simulate's; each unit whole sharded leaves, the other chunks replicated ones."""
  from prophet_jax.schedulers import fsdp

  n = NETWORKS[net]
  p = _sharded(PROFILES[prof], n.workers)
  assert p.sharded
  for cross_step in (False, True):
    s = fsdp()(p, n, cross_step=cross_step)
    assert s.policy == "fsdp" and s.cross_step is cross_step and s.tree_fingerprint == p.fingerprint()
    assert_covers_exactly_once(s, p)
    assert fsdp()(p, n, cross_step=cross_step) == s and Schedule.from_json(s.to_json()) == s
    units = set(s.fsdp.units)
    for k, c in enumerate(s.chunks):
      assert all((p.rows[r].shard_dim is not None) == (k in units) for r, _, _ in c.slices)
      assert k not in units or all((a, b) == (0, p.rows[r].size) for r, a, b in c.slices)
    assert simulate(s, p, n, cross_step=cross_step).iteration_s == pytest.approx(s.predicted_s, rel=1e-9)
