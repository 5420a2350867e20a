"""Changing plans with `convert_state` (issue 36): pairs of plan families (lossless all-reduce L, dlcp D,
dear Z, every_k K, pipelined P) converted both ways, a pairwise cover over pmap, shard_map and the jit
path (with tests/test_replan.py: D->L on the jit path, D->D under shard_map, D->L pipelined).

Integer-valued gradients keep every sum exact. Lossless pairs (sgd with momentum, whose state the
conversion must carry): the params after the switch equal the never-switched run's, bit for bit; the
control (the new plan's fresh state: the momentum lost) differs. Lossy pairs (sgd): conservation, the
params' change times the axis size plus what the last state still defers equals every true gradient
(weighted 1/k under every_k); the control (the owed values dropped) fails it.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import prophet_jax as pj
from test_replan import A, AX, B_LOSSLESS, NDEV, TREE, _grads, _residual_sum

DEAR = pj.plan(pj.GradientProfile.from_params(TREE), pj.NetworkModel.preset("10gbe", workers=NDEV), "dear")
SCHED = {"L": B_LOSSLESS, "D": A, "Z": DEAR, "K": B_LOSSLESS}
MOMENTUM = optax.sgd(1.0, momentum=0.5)
SGD = optax.sgd(1.0)


@functools.lru_cache(maxsize=None)
def _pmap(fam, tx):
  stx = pj.scheduled(tx, SCHED[fam], axis_name=AX, every_k=2 if fam == "K" else 1)

  def step(p, g, opt):
    u, opt = stx.update(g, opt, p)
    return optax.apply_updates(p, u), opt

  return jax.pmap(lambda _: stx.init(TREE), axis_name=AX), jax.pmap(step, axis_name=AX)


@functools.lru_cache(maxsize=None)
def _shard_map(fam, tx, first=None):
  mesh = jax.make_mesh((NDEV,), (AX,))
  stx = pj.scheduled(tx, SCHED[fam], axis_name=AX, every_k=2 if fam == "K" else 1)
  spec = pj.state_specs(jax.eval_shape(jax.shard_map(lambda: stx.init(TREE), mesh=mesh, in_specs=(),
                                                     out_specs=P(), check_vma=False)), AX)

  def step(p, g, opt):
    u, opt = stx.update(jax.tree.map(lambda x: x[0], g), opt, p)
    return optax.apply_updates(p, u), opt

  def make(spec_in, spec_out):
    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(AX), spec_in), out_specs=(P(), spec_out)))

  return mesh, stx, spec, make


def _run(a, b, tx, mapping, grads, switch, how):
  """Steps of plan a, then (from step `switch`) plan b; `how`: 'convert', 'fresh' (the new plan's
  init) or 'drop' (the converted state without its owed values). Returns (params on the host, state)."""
  if mapping == "pmap":
    init_a, step_a = _pmap(a, tx)
    init_b, step_b = _pmap(b, tx)
    p, opt = jax.pmap(lambda _: TREE)(np.arange(NDEV)), init_a(np.arange(NDEV))
    put = lambda g: g  # noqa: E731
  else:
    mesh, _, spec_a, make_a = _shard_map(a, tx)
    _, stx_b, spec_b, make_b = _shard_map(b, tx)
    step_a, step_b = make_a(spec_a, spec_a), make_b(spec_b, spec_b)
    p = jax.device_put(TREE, NamedSharding(mesh, P()))
    opt = jax.jit(jax.shard_map(_shard_map(a, tx)[1].init, mesh=mesh, in_specs=P(), out_specs=spec_a))(TREE)
    put = lambda g: jax.device_put(g, NamedSharding(mesh, P(AX)))  # noqa: E731
  for t, g in enumerate(grads):
    if t == switch:
      if how == "fresh":
        opt = (init_b(np.arange(NDEV)) if mapping == "pmap" else
               jax.jit(jax.shard_map(stx_b.init, mesh=mesh, in_specs=P(), out_specs=spec_b))(TREE))
      else:
        kw = {"mesh": mesh, "axis_name": AX} if mapping == "shard_map" else {"num_devices": NDEV}
        kw["every_k"] = 2 if b == "K" else (1 if a == "K" else None)
        opt = pj.convert_state(opt, TREE, SCHED[b], tx=tx, **kw)
        if how == "drop":
          opt = pj._rewrite._convert_state.steady_state(opt)
      first = isinstance(opt.defer_state, pj.OwedState)
      if first and mapping == "shard_map":
        spec_in, spec_out = pj.first_step_specs(opt, AX)
        p, opt = make_b(spec_in, spec_out)(p, put(g), opt)
        continue
    step = step_a if t < switch else step_b
    p, opt = step(p, put(g), opt)
  host = jax.tree.map(lambda x: np.asarray(x, np.float64)[0] if mapping == "pmap" else np.asarray(x, np.float64),
                      p)
  return host, opt


LOSSLESS = [("L", "Z", "pmap"), ("Z", "L", "shard_map")]


@pytest.mark.parametrize("a,b,mapping", LOSSLESS)
def test_a_lossless_switch_equals_the_never_switched_run(a, b, mapping):
  grads = _grads(11, 4)
  never, _ = _run(a, a, MOMENTUM, mapping, grads, 99, "convert")
  got, _ = _run(a, b, MOMENTUM, mapping, grads, 2, "convert")
  for k in TREE:
    np.testing.assert_array_equal(got[k], never[k], err_msg=k)
  fresh, _ = _run(a, b, MOMENTUM, mapping, grads, 2, "fresh")     # the control: the momentum lost
  assert any(not np.array_equal(fresh[k], never[k]) for k in TREE)


LOSSY = [("D", "Z", "pmap"), ("Z", "D", "shard_map"), ("D", "L", "shard_map"), ("D", "K", "pmap"),
         ("K", "D", "shard_map")]


def _conserved(grads, switch, a, b, params, held):
  """every_k's update is the mean of its k micro-steps: each gradient counts 1/k there."""
  w = lambda fam: 0.5 if fam == "K" else 1.0  # noqa: E731
  for k in TREE:
    true = sum(np.asarray(g[k], np.float64).sum(0) * (w(a) if t < switch else w(b)) for t, g in enumerate(grads))
    np.testing.assert_array_equal(-NDEV * params[k] + held[k], true, err_msg=f"conservation of leaf {k}")


@pytest.mark.parametrize("a,b,mapping", LOSSY)
def test_a_lossy_switch_conserves_every_value(a, b, mapping):
  grads = _grads(12, 4)   # K: the switch and the end at multiples of k = 2
  params, opt = _run(a, b, SGD, mapping, grads, 2, "convert")
  if mapping == "pmap":
    held = _residual_sum(opt.defer_state, SCHED[b]) if SCHED[b].defers else _residual_sum(None, None)
  else:
    held = {k: np.zeros(v.shape) for k, v in TREE.items()}
    if SCHED[b].defers:
      mesh = jax.make_mesh((NDEV,), (AX,))
      spec = pj.state_specs(opt, AX)
      per = jax.jit(jax.shard_map(lambda o: jax.tree.map(lambda x: x[None], pj.deferred_grads(o, TREE)),
                                  mesh=mesh, in_specs=(spec,), out_specs=P(AX)))(opt)
      held = {k: np.asarray(per[k], np.float64).sum(0) for k in TREE}
  _conserved(grads, 2, a, b, params, held)
  if a == "D":   # the control: the owed values dropped
    params, opt = _run(a, b, SGD, mapping, grads, 2, "drop")
    if mapping == "pmap":
      held = _residual_sum(opt.defer_state, SCHED[b]) if SCHED[b].defers else _residual_sum(None, None)
    with pytest.raises(AssertionError, match="conservation"):
      _conserved(grads, 2, a, b, params, held)


def test_the_step_names_convert_state_and_the_tag_says_what_it_is():
  """The in-step carry is retired: the step raises naming convert_state (a ZeRO-1 state given to an
  all-reduce plan too); where jax compares structures first, the tag's text names it."""
  init_d, _ = _pmap("D", SGD)
  _, step_l = _pmap("L", SGD)
  _, step_z = _pmap("Z", SGD)
  p = jax.pmap(lambda _: TREE)(np.arange(NDEV))
  g = _grads(13, 1)[0]
  with pytest.raises(pj.ScheduleMismatchError, match="convert_state"):
    step_l(p, g, init_d(np.arange(NDEV)))
  init_z, _ = _pmap("Z", MOMENTUM)
  with pytest.raises(pj.ScheduleMismatchError, match="convert_state"):
    _pmap("L", MOMENTUM)[1](p, g, init_z(np.arange(NDEV)))
  owed = pj.convert_state(init_d(np.arange(NDEV)), TREE, B_LOSSLESS)
  assert "convert_state" in repr(owed.defer_state.tag) and "convert_state" in repr(init_d(0 + np.arange(NDEV)).defer_state.tag)
  with pytest.raises(pj.ScheduleMismatchError, match="another schedule's first step"):
    step_z(p, g, owed._replace(inner=jax.pmap(lambda _: pj.scheduled(SGD, DEAR, axis_name=AX).init(TREE).inner,
                                              axis_name=AX)(np.arange(NDEV))))
  with pytest.raises(TypeError, match="no state of this library"):
    pj.convert_state({"step": 3}, TREE, A)


def test_containers_come_back_as_they_went_in_and_the_monitor_converts():
  init_d, step_d = _pmap("D", SGD)
  opt = init_d(np.arange(NDEV))
  p = jax.pmap(lambda _: TREE)(np.arange(NDEV))
  p, opt = step_d(p, _grads(14, 1)[0], opt)
  held = _residual_sum(opt, A)
  box = {"opt": (opt, optax.EmptyState()), "step": 3}
  out = pj.convert_state(box, TREE, B_LOSSLESS)
  assert set(out) == {"opt", "step"} and out["step"] == 3 and isinstance(out["opt"], tuple)
  assert isinstance(opt.defer_state, pj.DeferState)                    # nothing mutated
  owed = out["opt"][0].defer_state
  assert isinstance(owed, pj.OwedState)
  total = sum(np.asarray(o, np.float64).sum() for o in owed.owed)
  assert total == sum(v.sum() for v in held.values()) and sum(np.abs(v).sum() for v in held.values()) > 0
  mon = pj.Monitor(pj.GradientProfile.from_params(TREE), pj.NetworkModel.preset("10gbe", workers=NDEV),
                   schedule=B_LOSSLESS, num_devices=NDEV)
  via = mon.convert_state(opt, TREE)
  for x, y in zip(jax.tree.leaves(via), jax.tree.leaves(out["opt"][0])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@functools.lru_cache(maxsize=None)
def _pipe(fam):
  from test_replan import _linear_loss
  pipe = pj.pipelined(_linear_loss, MOMENTUM, SCHED[fam], axis_name=AX)
  return (pipe, jax.pmap(lambda _: pipe.init(TREE), axis_name=AX), jax.pmap(pipe.step, axis_name=AX),
          jax.pmap(pipe.flush, axis_name=AX))


@pytest.mark.parametrize("a,b", [("Z", "L"), ("L", "Z")])
def test_pipelined_lossless_switch_equals_the_never_switched_run(a, b):
  """A flushed pipelined state converted between dear (its ZeRO-1 momentum) and an all-reduce plan;
  a pending forward is refused; the control (the new plan's fresh state) differs."""
  batches = _grads(15, 5)

  def run(switch, how):
    _, init, step, flush = _pipe(a)
    st = init(np.arange(NDEV))
    for t, x in enumerate(batches):
      if t == switch:
        if how == "pending":
          pj.convert_state(st, TREE, SCHED[b], tx=MOMENTUM, num_devices=NDEV)
        st = flush(st)
        _, init_b, step, flush = _pipe(b)
        st = (pj.convert_state(st, TREE, SCHED[b], tx=MOMENTUM, num_devices=NDEV) if how == "convert" else
              st._replace(opt_state=init_b(np.arange(NDEV)).opt_state))
      st, _ = step(st, x)
    return {k: np.asarray(v)[0] for k, v in flush(st).params.items()}

  never = run(99, "convert")
  got = run(3, "convert")
  for k in TREE:
    np.testing.assert_array_equal(got[k], never[k], err_msg=k)
  fresh = run(3, "fresh")
  assert any(not np.array_equal(fresh[k], never[k]) for k in TREE)
  with pytest.raises(ValueError, match=r"pending forward.*flush"):
    run(3, "pending")
