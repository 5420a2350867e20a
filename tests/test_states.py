"""The state layer (prophet_jax/_rewrite/_states.py, _convert.py): one tag, one `state_specs`, one
conversion between schedules.

- States saved before the layer existed (commit 5dc8ac8) and before `pipelined` ran the per-device
  update (7963a23; tests/fixtures/make_states.py wrote them: a deferring `dlcp` state, a ZeRO-1 `dear`
  state, an `every_k` accumulator, flushed `pipelined` states of both plans) have the key paths
  today's `init` makes, and today's step takes their leaves (traced under pmap: every check runs).
- `convert` moves every value bit for bit: a deferral residual comes back in `owed` at the elements it
  was deferred from (per device, in each layout); a ZeRO-1 state goes to the whole state and back, to
  another device count and to an all-reduce schedule, equal to `shard_state`/`unshard_state` of the
  same values. Controls: the owed values of another device, and a state converted to its own
  schedule (kept, nothing owed).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import prophet_jax as pj
from prophet_jax._rewrite import _convert, _defer, _states

N, AX = 8, "data"
FIX = pathlib.Path(__file__).resolve().parent / "fixtures"


def _maker():
  spec = importlib.util.spec_from_file_location("make_states", FIX / "make_states.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


MAKE = _maker()
FIXTURES = ("5dc8ac8", "7963a23")   # saved before the state layer; before pipelined ran scheduled's update
SAVED = {c: (json.loads((FIX / f"states-{c}.json").read_text())["cases"], np.load(FIX / f"states-{c}.npz"))
         for c in FIXTURES}
META = SAVED["5dc8ac8"][0]


def _case(case, commit="5dc8ac8"):
  meta, arrays = SAVED[commit]
  m = meta[case]
  schedule = pj.Schedule.from_json(m["schedule"])
  if case in MAKE.PIPELINED:
    tx = pj.pipelined(MAKE.loss_fn, MAKE.tx_for(case), schedule, axis_name=AX)
  else:
    tx = pj.scheduled(MAKE.tx_for(case), schedule, axis_name=AX, every_k=m["every_k"])
  leaves = [arrays[f"{case}/{i}"] for i in range(len(m["paths"]))]
  return schedule, tx, leaves


@pytest.mark.parametrize("commit,case", [(c, k) for c in FIXTURES for k in sorted(SAVED[c][0])])
def test_a_state_saved_before_the_state_layer_restores(commit, case):
  schedule, tx, leaves = _case(case, commit)
  params = MAKE.params()
  rep = jax.tree.map(lambda x: jnp.broadcast_to(x, (N, *x.shape)), params)
  now = jax.eval_shape(jax.pmap(tx.init, axis_name=AX), rep)
  flat, treedef = jax.tree_util.tree_flatten_with_path(now)
  assert [jax.tree_util.keystr(p) for p, _ in flat] == SAVED[commit][0][case]["paths"]
  assert [tuple(x.shape[1:]) for _, x in flat] == [np.shape(x) for x in leaves]
  assert [str(x.dtype) for _, x in flat] == [str(x.dtype) for x in leaves]
  restored = jax.tree_util.tree_unflatten(treedef, [np.broadcast_to(x, (N, *x.shape)) for x in leaves])
  if case in MAKE.PIPELINED:
    step = jax.pmap(tx.step, axis_name=AX)
    new, _ = jax.eval_shape(step, *jax.eval_shape(step, restored, MAKE.batch(0))[:1], MAKE.batch(1))
    new = jax.eval_shape(jax.pmap(tx.flush, axis_name=AX), new)
  else:
    step = jax.pmap(lambda g, s, p: tx.update(g, s, p), axis_name=AX)
    updates, new = jax.eval_shape(step, MAKE.grads(0), restored, rep)
  assert jax.tree.structure(new) == jax.tree.structure(restored)


def _residual_at_elements(owed, schedule, state):
  """Every deferred row's values read back from `owed` at its chunk's slices, per group."""
  rows = schedule.rows
  leaves = {p: np.asarray(x).reshape(-1) for p, x in zip([r[0] for r in rows], _rows_of(owed, schedule))}
  out = []
  for g, gs in zip(_defer.defer_groups(schedule), _defer.group_states(state)):
    for j, c in enumerate(np.asarray(gs.index)):
      chunk = g.chunks[int(c)]
      vals = np.concatenate([leaves[rows[r][0]][a:b] for r, a, b in chunk.slices])
      out.append((vals, np.asarray(gs.residual)[0, j, :chunk.size]))
  return out


def _rows_of(tree, schedule):
  from prophet_jax._values._checks import match_tree
  lw, _ = jax.tree_util.tree_flatten_with_path(tree)
  lmap = match_tree(lw, schedule, where="test")
  return [lw[i][1] for i in lmap.row_leaf]


def test_convert_gives_a_deferral_residual_back_bit_for_bit_in_every_layout():
  schedule, tx, leaves = _case("dlcp")
  params = MAKE.params()
  _, treedef = jax.tree_util.tree_flatten(jax.eval_shape(tx.init, params))
  state = jax.tree_util.tree_unflatten(treedef, leaves)          # device 0's, as inside the mapping
  assert sum(np.count_nonzero(r) for r in state.defer_state.residual) > 10   # deferred values
  lossless = _defer.lossless(schedule)
  out, owed = _convert.convert(state, params, lossless)
  assert out.defer_state is None and out.inner is state.inner
  for got, want in _residual_at_elements(owed, schedule, state.defer_state):
    np.testing.assert_array_equal(got, want)            # bit for bit
  # every other element owes nothing
  total = sum(np.count_nonzero(np.asarray(x)) for x in jax.tree.leaves(owed))
  assert total == sum(np.count_nonzero(r) for r in state.defer_state.residual)
  # kept as it is for its own schedule: nothing owed
  same, none = _convert.convert(state, params, schedule)
  assert none is None and same.defer_state is state.defer_state
  # pmap's layout (n, 1, ...): each device's own residual, its own owed values
  d = state.defer_state
  scale = np.arange(1, N + 1, dtype=np.float32)
  stacked = d._replace(
      norms=tuple(np.broadcast_to(x, (N, *x.shape)) for x in d.norms),
      deferred=tuple(np.broadcast_to(x, (N, *x.shape)) for x in d.deferred),
      index=tuple(np.broadcast_to(x, (N, *x.shape)) for x in d.index),
      residual=tuple(scale.reshape(N, 1, 1, 1) * np.asarray(r)[None] for r in d.residual))
  new, owed8 = _convert.convert({"opt": stacked}, params, lossless)
  assert new == {"opt": None}
  for i in (0, 5):
    mine = d._replace(residual=tuple(np.asarray(r)[i] for r in stacked.residual))
    for got, want in _residual_at_elements(jax.tree.map(lambda x: x[i], owed8), schedule, mine):
      np.testing.assert_array_equal(got, want)
  with pytest.raises(AssertionError):   # the control: device 5's values are not device 0's
    mine = d._replace(residual=tuple(np.asarray(r)[0] for r in stacked.residual))
    for got, want in _residual_at_elements(jax.tree.map(lambda x: x[5], owed8), schedule, mine):
      np.testing.assert_array_equal(got, want)
  # a state that does not record its schedule is named
  bare = d._replace(tag=_states.StateTag(d.tag.key, d.tag.fingerprint, d.tag.layout))
  with pytest.raises(ValueError, match="does not record the schedule"):
    _convert.convert(bare, params, lossless)


def test_convert_moves_a_zero1_state_between_device_counts_and_plans_bit_for_bit():
  dear, _, _ = _case("dear")
  auto = pj.Schedule.from_json(META["every_k"]["schedule"])
  params = MAKE.params()
  tx = MAKE.tx_for("dear")
  whole = tx.init(params)
  rng = np.random.default_rng(0)
  whole = jax.tree.map(lambda x: rng.standard_normal(np.shape(x)).astype(x.dtype)
                       if np.ndim(x) else np.asarray(x) + 3, whole)
  eight = _states.ScheduledState(inner=pj.shard_state(whole, tx, params, dear, N))
  assert eight.inner == _convert.convert(eight, params, dear, tx=tx).state.inner   # its own: kept
  back, owed = _convert.convert(eight, params, auto, tx=tx)
  assert owed is None and not isinstance(back.inner, pj.ShardedState)
  for x, y in zip(jax.tree.leaves(back.inner), jax.tree.leaves(whole)):
    np.testing.assert_array_equal(x, y)
  four = _convert.convert(eight, params, dear, tx=tx, n=4).state
  assert four.inner.tag.n == 4
  cut = _convert.convert(back, params, dear, tx=tx, n=4).state   # an all-reduce plan's state, cut
  for x, y in zip(jax.tree.leaves(cut), jax.tree.leaves(four)):
    np.testing.assert_array_equal(x, y)
  for x, y in zip(jax.tree.leaves(pj.unshard_state(four.inner, tx, params, dear)), jax.tree.leaves(whole)):
    np.testing.assert_array_equal(x, y)
  with pytest.raises(ValueError, match="tx="):
    _convert.convert(eight, params, auto)
