"""The lower bound (valid for every schedule, tight on small instances) and the brute-force optima."""


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prophet_jax import NetworkModel
from prophet_jax._planning._bound import lower_bound
from _brute import (_enumerate_ordered, best_contiguous, best_ordered, random_deferral, random_network,
                    random_profile, random_schedule, split_group)
from prophet_jax import Bucket, Chunk, Schedule
from prophet_jax._planning._simulate import simulate

from _instances import NET, PROFILE
from _instances import row as _row, sched as _sched

SEEDS = st.integers(0, 2**32 - 1)
REL = 1e-9  # float rounding between the bound's and the simulator's sums




def test_hand_bounds():
  # plain, overlap: thresholds: S_3.0 = {A}: 3.0 + 0.5 + 1.0 = 4.5; S_1.0 = {A, B}: 1.0 + 0.5 + 3.0
  # = 4.5. Batching (rows in ready order B, A): {B}{A}: B 1.0-3.5, A 3.5-5.0; {B, A}: 3.0 + 3.5 =
  # 6.5; so the last chunk ends >= 5.0. max(backward 3.0, 4.5, 5.0) + update 0.3 + forward 1.5 =
  # 6.8, what wfbp takes: attained.
  assert lower_bound(PROFILE, NET) == pytest.approx(6.8)
  # pipelined: tail(A) = u(A) + f(A) + f(B) = 1.6, tail(B) = 0.2 + 0.5 = 0.7. Layer A alone:
  # 3.0 + 1.5 + 1.6 = 6.1; B alone: 1.0 + 2.5 + 0.7 = 4.2; A..B: 4.5 + min(1.6, 0.7) = 5.2;
  # compute: 3.0 + 1.5 = 4.5. Batching: {A}: 4.5 + 1.6 = 6.1; {A, B}: 5.0 + 0.7. Preemptive: B runs
  # 1.0-3.0 (3.0 + 0.7), A 3.0-4.0 (4.0 + 1.6), + a = 6.1. Split, holding A (ready after B): either
  # A's chunk is last, ending >= M(B, A) = 5.0: 5.0 + 1.6 = 6.6; or some of B's bytes follow it: A's
  # chunk ends >= M(A) = 4.5 (4.5 + 1.6 = 6.1) and the last chunk >= M(B, A) + a = 5.5 (5.5 + 0.7 =
  # 6.2): min(6.6, max(6.1, 6.2)) = 6.2. Bound 6.2 (wfbp order takes 6.6).
  assert lower_bound(PROFILE, NET, cross_step=True) == pytest.approx(6.2)
  # no overlap: backward 3.0 + W(all) = 0.5 + 3.0, + 1.8 = 8.3, which one merged chunk attains.
  no = NET.replace(overlap=False)
  assert lower_bound(PROFILE, no, sharded=False) == pytest.approx(8.3)
  assert simulate(_sched(PROFILE, [[0, 1]]), PROFILE, no).iteration_s == pytest.approx(8.3)
  # ... but a sharded schedule updates 1/P = 1/2 of the parameters: one reduce-scatter after backward
  # (3.0 + 0.25 + 1.5), the update 0.3 / 2, one all-gather 1.75, forward 1.5: 8.15, the bound over
  # every schedule (B_sharded: max(3.0 + W'(all) = 4.75, thresholds) + U' 0.15 + W'(all) + F)
  assert lower_bound(PROFILE, no) == pytest.approx(8.15)
  assert lower_bound(PROFILE, no, sharded=True) == pytest.approx(8.15)
  one = Schedule(buckets=_sched(PROFILE, [[0, 1]]).buckets, rows=PROFILE.tree_rows(), gathers=((0,),))
  assert simulate(one, PROFILE, no).iteration_s == pytest.approx(8.15)
  # two links (no batching term): W(S_1.0) = max(0.5 * ceil(1/2), (0.5 + 3.0) / 2) = 1.75: 1.0 +
  # 1.75 = 2.75; S_3.0: max(0.5, 1.5 / 2) = 0.75: 3.75. max(3.0, 3.75) + 1.8 = 5.55.
  assert lower_bound(PROFILE, NET.replace(links=2)) == pytest.approx(5.55)


def test_free_network_bound_is_compute():
  free = NET.replace(alpha_s=0.0, beta_s_per_byte=0.0)
  assert lower_bound(PROFILE, free, sharded=False) == pytest.approx(PROFILE.compute_s)
  # a sharded schedule updates 1/P of the parameters: forward + backward + update / 2
  assert lower_bound(PROFILE, free) == pytest.approx(PROFILE.compute_s - PROFILE.update_s / 2)
  # pipelined: update is a latency: A's forward waits for A's update at 3.0 + 0.1: 3.1 + 1.5 = 4.6
  assert lower_bound(PROFILE, free, cross_step=True, sharded=False) == pytest.approx(4.6)
  # sharded, the bound leaves the (halved) update latency out: backward 3.0 + forward 1.5
  assert lower_bound(PROFILE, free, cross_step=True) == pytest.approx(4.5)
  assert simulate(_sched(PROFILE, [[1], [0]]), PROFILE, free, cross_step=True).iteration_s == \
      pytest.approx(4.6)


def _simple_schedules(p, rng):
  """One chunk per row (ready order and priority order), one per dtype, random contiguous merges of
  the ready order, and random slices, merges and orders."""
  sent = [i for i in p.ready_order() if p.rows[i].nbytes > 0]
  if not sent:
    return []
  out = [_sched(p, [[i] for i in sent]), _sched(p, [[i] for i in sorted(sent)])]
  by_dtype = {}
  for i in sent:
    by_dtype.setdefault(p.rows[i].dtype, []).append(i)
  out.append(_sched(p, list(by_dtype.values())))
  for _ in range(2):
    groups, cur = [], []
    for i in sent:
      if cur and (p.rows[cur[-1]].dtype != p.rows[i].dtype or rng.random() < 0.5):
        groups.append(cur)
        cur = []
      cur.append(i)
    groups.append(cur)
    out.append(_sched(p, groups))
  out += [random_schedule(p, rng) for _ in range(3)]
  return out


def _instance(seed, lo, hi, net_kw):
  """A random profile of lo..hi-1 layers (float32 and bfloat16, a tenth of the rows empty) and a random
  network for it (`net_kw(rng)` its options, drawn after the profile); the generator, drawn on after them."""
  rng = np.random.default_rng(seed)
  p = random_profile(rng, int(rng.integers(lo, hi)), dtypes=("float32", "bfloat16"), zero_prob=0.1)
  return rng, p, random_network(rng, p, **net_kw(rng))


@settings(deadline=None, max_examples=60)
@given(SEEDS, st.booleans(), st.sampled_from([0.1, 1.0, 5.0]))
def test_bound_below_every_schedule(seed, cross_step, comm_ratio):
  rng, p, net = _instance(seed, 1, 9, lambda rng: dict(comm_ratio=comm_ratio))
  lb = lower_bound(p, net, cross_step=cross_step)
  assert lb >= p.backward_s + p.forward_s - 1e-12
  for s in _simple_schedules(p, rng):
    t = simulate(s, p, net, cross_step=cross_step, events=False).iteration_s
    assert lb <= t * (1 + REL), (s.describe(), lb, t)


def test_bound_below_every_policy():
  from prophet_jax import plan
  from prophet_jax.schedulers._registry import POLICIES

  names = [n for n in POLICIES if n != "fsdp"]    # dlcp at its default: lossless; fsdp needs a sharded
                                                  # profile: its bound is test_fsdp's
  rng = np.random.default_rng(7)
  checked = 0
  for _ in range(4):
    p = random_profile(rng, int(rng.integers(2, 12)), dtypes=("float32", "bfloat16"), zero_prob=0.05)
    for overlap in (True, False):
      net = random_network(rng, p, overlap=overlap, comm_ratio=float(rng.choice([0.3, 2.0])))
      for cross_step in (False, True):
        lb = lower_bound(p, net, cross_step=cross_step)
        for name in names:
          n = net.replace(links=1) if name == "dear" else net    # sharded schedules: one link
          s = plan(p, n, name, cross_step=cross_step)
          t = simulate(s, p, n, cross_step=cross_step, events=False).iteration_s
          bound = lb if n is net else lower_bound(p, n, cross_step=cross_step)
          assert bound <= t * (1 + REL), (name, cross_step, bound, t)
          checked += 1
  assert checked >= 4 * 2 * 2 * len(names)


@settings(deadline=None, max_examples=40)
@given(SEEDS, st.sampled_from([0.3, 1.0, 3.0, 10.0]))
def test_bound_below_brute_force(seed, comm_ratio):
  rng, p, net = _instance(seed, 1, 7, lambda rng: dict(links=1, overlap=bool(rng.random() < 0.7),
                                                              comm_ratio=comm_ratio))
  n = sum(r.nbytes > 0 for r in p.rows)
  for cross_step in (False, True):
    lb = lower_bound(p, net, cross_step=cross_step)
    if net.overlap or n <= 5:
      t, s = best_ordered(p, net, cross_step=cross_step)
      assert lb <= t * (1 + REL)
      assert simulate(s, p, net, cross_step=cross_step).iteration_s == pytest.approx(t, rel=REL)
  t, s = best_contiguous(p, net)
  assert lower_bound(p, net) <= t * (1 + REL)
  assert simulate(s, p, net).iteration_s == pytest.approx(t, rel=REL)


def tightness_failures(r) -> list[str]:
  """What is loose in these bound/optimum ratios; empty when the bound is tight.

  docs/design.md asks for a median >= 0.9; the bound does much better (it equals the optimum on most
  instances: median 1.000, mean 0.994 / 0.988, over 90% of instances within 5%, measured with the
  seed below), and a criterion at 0.9 would pass a bound 10% too low. These thresholds sit between
  what the bound achieves and what a 5% looser one would give, so a 10% loosening fails them.
  """
  r = np.asarray(r)
  out = []
  if np.median(r) < 0.99:
    out.append(f"median bound/optimum {np.median(r):.3f} < 0.99")
  if np.mean(r) < 0.97:
    out.append(f"mean bound/optimum {np.mean(r):.3f} < 0.97")
  if np.mean(r >= 0.95) < 0.85:
    out.append(f"only {np.mean(r >= 0.95):.0%} of instances have bound/optimum >= 0.95 (< 85%)")
  return out


def test_bound_is_tight_on_small_instances():
  # bound / brute-force optimum over random instances of <= 6 leaves, one link, both step modes,
  # communication from light (0.3x backward) to heavy (10x).
  rng = np.random.default_rng(11)
  ratios = {False: [], True: []}
  for k in range(120):
    p = random_profile(rng, int(rng.integers(1, 7)), dtypes=("float32", "bfloat16"), zero_prob=0.05)
    net = random_network(rng, p, links=1, overlap=True, comm_ratio=[0.3, 1.0, 3.0, 10.0][k % 4])
    # (the ordered optimum: with two dtypes the best contiguous merge of the ready order is not
    # always optimal, and the bound is measured against the best schedule)
    ratios[False].append(lower_bound(p, net, sharded=False) / best_ordered(p, net, cross_step=False)[0])
    ratios[True].append(lower_bound(p, net, cross_step=True, sharded=False)
                        / best_ordered(p, net, cross_step=True)[0])
  for mode, r in ratios.items():
    assert np.max(r) <= 1 + REL
    assert np.median(r) >= 0.9, f"cross_step={mode}: median bound/optimum {np.median(r):.3f}"  # docs/design.md
    assert not tightness_failures(r), f"cross_step={mode}: {tightness_failures(r)}"
    # the criterion is sharp: the same bound 10% (or 5%) lower fails it
    assert tightness_failures(0.9 * np.asarray(r)), f"cross_step={mode}: a 10% looser bound passes"
    assert tightness_failures(0.95 * np.asarray(r)), f"cross_step={mode}: a 5% looser bound passes"


# --------------------------------------------------------------------------------------------------
# deferral (max_defer): a bound over schedules that defer at most that fraction per step


@settings(deadline=None, max_examples=50)
@given(SEEDS, st.booleans(), st.sampled_from([0.3, 2.0, 8.0]))
def test_deferral_bound_below_every_deferring_schedule(seed, cross_step, comm_ratio):
  rng, p, net = _instance(seed, 1, 9, lambda rng: dict(comm_ratio=comm_ratio))
  for _ in range(4):
    s = random_deferral(random_schedule(p, rng), rng, prob=0.7)
    f = s.max_deferred_fraction
    lb = lower_bound(p, net, cross_step=cross_step, max_defer=f)
    assert lb <= lower_bound(p, net, cross_step=cross_step) * (1 + 1e-12)
    assert lb >= p.backward_s + p.forward_s - 1e-12
    t = simulate(s, p, net, cross_step=cross_step, events=False).iteration_s
    assert lb <= t * (1 + REL), (s.describe(), lb, t)


_OPTIONS = ((1, 0), (2, 1), (3, 1), (4, 1), (4, 2))   # (parts m, deferred k) per chunk


def _best_deferring(p, net, cross_step, max_defer):
  """The best schedule of whole leaves (every ordered partition into chunks of one dtype), each chunk
  sent whole or as a deferral group of m equal parts with k deferred, deferring at most max_defer."""
  import itertools

  from _brute import _ordered_partitions

  seq = [i for i in range(len(p.rows)) if p.rows[i].nbytes > 0]
  total = sum(r.size for r in p.rows)
  best = np.inf
  for groups in _ordered_partitions(seq, [p.rows[i].dtype for i in seq]):
    chunks = [Chunk(slices=tuple((r, 0, p.rows[r].size) for r in g), dtype=p.rows[g[0]].dtype) for g in groups]
    for opts in itertools.product(_OPTIONS, repeat=len(chunks)):
      if any(m > c.size for c, (m, _) in zip(chunks, opts)):
        continue
      buckets = tuple(split_group(c, m, k) if k else Bucket(chunks=(c,)) for c, (m, k) in zip(chunks, opts))
      s = Schedule(buckets=buckets, rows=p.tree_rows())
      if s.max_deferred_fraction <= max_defer * (1 + 1e-12):
        best = min(best, simulate(s, p, net, cross_step=cross_step, events=False).iteration_s)
  return best


@settings(deadline=None, max_examples=12)
@given(SEEDS, st.sampled_from([0.3, 3.0, 10.0]), st.sampled_from([0.1, 0.3, 0.5]))
def test_deferral_bound_below_brute_force(seed, comm_ratio, max_defer):
  rng, p, net = _instance(seed, 1, 4, lambda rng: dict(links=1, overlap=bool(rng.random() < 0.7),
                                                              comm_ratio=comm_ratio))
  for cross_step in (False, True):
    lb = lower_bound(p, net, cross_step=cross_step, max_defer=max_defer)
    best = _best_deferring(p, net, cross_step, max_defer)
    assert lb <= best * (1 + REL), (lb, best)
    # deferral can beat every lossless schedule: the lossless bound is not a bound here, this one is
    assert best <= best_ordered(p, net, cross_step=cross_step)[0] * (1 + REL) or not net.overlap


def test_deferral_bound_errors_and_hand_value():
  with pytest.raises(ValueError, match=r"lower_bound\(\): max_defer=1.0 must be a fraction"):
    lower_bound(PROFILE, NET, max_defer=1.0)
  with pytest.raises(ValueError, match=r"max_defer=-0.5"):
    lower_bound(PROFILE, NET, max_defer=-0.5)
  # 750 elements; max_defer 0.2: D = 150 f32 = 600 B. no overlap: backward 3.0 + W = 0.5 +
  # (3000 - 600) B x 0.001 = 2.9, + 1.8 = 7.7 (8.3 lossless)
  no = NET.replace(overlap=False)
  assert lower_bound(PROFILE, no, max_defer=0.2) == pytest.approx(7.7)
  assert lower_bound(PROFILE, no, max_defer=0.0, sharded=False) == pytest.approx(8.3)


# --------------------------------------------------------------------------------------------------
# brute force


@settings(deadline=None, max_examples=25)
@given(SEEDS, st.booleans())
def test_pareto_dp_equals_enumeration(seed, cross_step):
  rng, p, net = _instance(seed, 1, 6, lambda rng: dict(links=1, overlap=True, comm_ratio=float(rng.choice([0.3, 3.0]))))
  t, s = best_ordered(p, net, cross_step=cross_step)
  assert t == pytest.approx(_enumerate_ordered(p, net, cross_step=cross_step), rel=REL)
  assert simulate(s, p, net, cross_step=cross_step).iteration_s == pytest.approx(t, rel=REL)
  # every ordered partition includes every contiguous merge of the ready order
  if not cross_step:
    assert t <= best_contiguous(p, net)[0] * (1 + REL)


def test_brute_force_sizes():
  rng = np.random.default_rng(5)
  p = random_profile(rng, 14, dtypes=("float32",))
  net = random_network(rng, p, links=1, overlap=True, comm_ratio=2.0)
  t, s = best_contiguous(p, net)
  assert simulate(s, p, net).iteration_s == pytest.approx(t, rel=REL)
  p8 = random_profile(rng, 8, dtypes=("float32",))
  net8 = random_network(rng, p8, links=1, overlap=True, comm_ratio=2.0)
  t, s = best_ordered(p8, net8)   # every one of the 545,835 ordered partitions, by the exact DP
  assert simulate(s, p8, net8, cross_step=True).iteration_s == pytest.approx(t, rel=REL)
  assert lower_bound(p8, net8, cross_step=True) <= t * (1 + REL)


def test_errors():
  big = random_profile(np.random.default_rng(0), 30)
  net = NetworkModel.preset("10gbe", workers=4)
  with pytest.raises(ValueError, match="at most 22"):
    best_contiguous(big, net)
  with pytest.raises(ValueError, match="at most 12"):
    best_ordered(big, net)
  with pytest.raises(TypeError, match="cross_step='auto'"):
    lower_bound(PROFILE, NET, cross_step="auto")
  with pytest.raises(TypeError, match="must be a prophet_jax.NetworkModel"):
    lower_bound(PROFILE, "10gbe")


@settings(deadline=None, max_examples=30)
@given(SEEDS)
def test_large_profile_path_is_weaker_but_valid(seed):
  # Large profiles use prefixes (evenly spaced ones when huge) and single layers instead of every
  # range of layers: a subset of the same terms, so never above the full bound, and still a bound.
  import prophet_jax._planning._bound as bound_mod

  rng, p, net = _instance(seed, 2, 12, lambda rng: dict(comm_ratio=float(rng.choice([0.3, 3.0]))))
  full = lower_bound(p, net, cross_step=True)
  names = ("_INTERVAL_WORK", "_PREFIX_WORK", "_BATCH_WORK", "_BATCH_PREFIXES", "_SPLIT_HELD")
  saved = {k: getattr(bound_mod, k) for k in names}
  try:
    for k, v in zip(names, (0, int(rng.choice([1, 5, 10**9])), 0, int(rng.integers(1, 4)),
                            int(rng.integers(1, 3)))):
      setattr(bound_mod, k, v)
    fast = lower_bound(p, net, cross_step=True)
  finally:
    for k, v in saved.items():
      setattr(bound_mod, k, v)
  assert fast <= full * (1 + REL)
  assert fast >= p.backward_s + p.forward_s - 1e-12
  for s in _simple_schedules(p, rng):
    assert fast <= simulate(s, p, net, cross_step=True, events=False).iteration_s * (1 + REL)


@settings(deadline=None, max_examples=60)
@given(SEEDS)
def test_batched_makespan_matches_quadratic_dp(seed):
  from prophet_jax._planning._bound import _batched_makespan

  rng = np.random.default_rng(seed)
  n = int(rng.integers(1, 12))
  ready = np.sort(rng.choice([0.0, 0.5, 1.0], n) if rng.random() < 0.3 else rng.uniform(0, 1, n))
  nbytes = rng.integers(1, 100, n).astype(float)
  a, b = float(rng.choice([0.0, rng.uniform(0, 1)])), float(rng.uniform(0, 0.02))
  # F(e) = min over s of max(F(s-1), ready_e) + a + b * bytes(s..e), the O(n^2) way
  cum = np.r_[0.0, np.cumsum(nbytes)]
  f = np.zeros(n + 1)
  for e in range(n):
    f[e + 1] = (np.maximum(f[:e + 1], ready[e]) + a + b * (cum[e + 1] - cum[:e + 1])).min()
  assert _batched_makespan(ready, nbytes, a, b) == pytest.approx(f[n], rel=1e-12, abs=1e-12)


def test_jackson_preemptive_lmax():
  from prophet_jax._planning._bound import _jackson_lmax

  # job 0 (released 0, 2 s of work, q 0) runs 0-1; job 1 (released 1, 1 s, q 5) preempts it, ends
  # at 2: 2 + 5 = 7; job 0 resumes and ends at 3: 3 + 0. L* = 7.
  assert _jackson_lmax(np.array([0.0, 1.0]), np.array([2.0, 1.0]), np.array([0.0, 5.0])) == 7.0
  # all released at 0: largest q first: 1 + 5 = 6, then 3 + 0 = 3
  assert _jackson_lmax(np.array([0.0, 0.0]), np.array([2.0, 1.0]), np.array([0.0, 5.0])) == 6.0


@settings(deadline=None, max_examples=40)
@given(SEEDS, st.sampled_from([0.3, 1.0, 3.0, 10.0]))
def test_single_dtype_plain_bound_is_attained(seed, comm_ratio):
  # one dtype, one link, overlap: the bound is the best contiguous merge of the ready order
  rng = np.random.default_rng(seed)
  p = random_profile(rng, int(rng.integers(1, 9)), zero_prob=0.1)
  net = random_network(rng, p, links=1, overlap=True, comm_ratio=comm_ratio)
  assert lower_bound(p, net, sharded=False) == pytest.approx(best_contiguous(p, net)[0], rel=1e-9)


def test_pareto_dp_equals_enumeration_six_leaves():
  # 4,683 ordered partitions of 6 leaves, one by one, against the dynamic program
  rng = np.random.default_rng(3)
  p = random_profile(rng, 6, dtypes=("float32",), max_layers=4)
  net = random_network(rng, p, links=1, overlap=True, comm_ratio=2.0)
  t, _ = best_ordered(p, net, cross_step=True)
  assert t == pytest.approx(_enumerate_ordered(p, net, cross_step=True), rel=REL)


@settings(deadline=None, max_examples=40)
@given(SEEDS)
def test_split_term_matches_its_definition(seed):
  # m_i = M(held rows + the i earliest others), each from the batching DP on the concatenation;
  # bound = min(m_K + tail_H, min_i max(m_i + tail_H, g_{i+1})).
  from prophet_jax._planning._bound import _batched_makespan, _split_term

  rng = np.random.default_rng(seed)
  k, h = int(rng.integers(0, 7)), int(rng.integers(1, 4))
  r_other = np.sort(rng.uniform(0, 1, k))
  r_hold = np.sort(rng.uniform(r_other.max() if k else 0.0, 1.2, h))
  b_other, b_hold = rng.integers(1, 100, k).astype(float), rng.integers(1, 100, h).astype(float)
  a, b = float(rng.uniform(0, 0.5)), float(rng.uniform(0, 0.02))
  tail_h, tail_min = float(rng.uniform(0, 1)), float(rng.uniform(0, 0.5))
  m = [_batched_makespan(np.r_[r_other[:i], r_hold], np.r_[b_other[:i], b_hold], a, b)
       for i in range(k + 1)]
  total = b_other.sum() + b_hold.sum()
  g = [m[j] + a + b * (total - b_hold.sum() - b_other[:j].sum()) + tail_min for j in range(k)]
  g.append(m[k] + a + tail_min)
  want = min([m[k] + tail_h] + [max(m[i] + tail_h, g[i + 1]) for i in range(k)])
  got = _split_term(r_other, b_other, r_hold, b_hold, a, b, tail_h, tail_min)
  assert got == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_bound_on_a_large_profile():
  # 1,000 leaves in 1,000 layers: the large-profile paths (speed is bench's, never a test's)
  rng = np.random.default_rng(0)
  p = random_profile(rng, 1000, max_layers=1000, dtypes=("float32", "bfloat16"))
  net = random_network(rng, p, links=1, overlap=True, comm_ratio=2.0)
  for cross_step in (False, True):
    lb = lower_bound(p, net, cross_step=cross_step)
    s = random_schedule(p, rng, in_ready_order=True)
    assert lb <= simulate(s, p, net, cross_step=cross_step, events=False).iteration_s * (1 + REL)
