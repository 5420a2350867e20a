"""Bad or unusual inputs as a new user gives them, and what each must give (issue 29).

One table per door. A row is (id, what the user does, what must happen):
- `raises(Exception, *words)`: that exception, its message containing every word (the field or flag, the
  value, the fix);
- `warns(Warning, *words)`: that warning, with the words;
- `ok(check)`: no error, and `check(result)` holds (a numpy scalar accepted, a composition that works).
CLI rows: exit code 2, exactly one line on stderr, holding the words.

The rows marked `I..` reconstruct issue 29's list (the inputs that got an unclear error, a wrong or lossy
result with no error, or a crash); the rows marked `N..` are the ones tried beyond it. Behaviours that
need a longer run have their own tests, named in the row's comment (tests/test_pressure.py,
tests/test_replan.py, tests/test_compositions.py, tests/test_readme.py).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import prophet_jax as pj
from prophet_jax import (GradientProfile, NetworkError, NetworkModel, ProfileError, Schedule, ScheduleError,
                         ScheduleMismatchError)
from prophet_jax._rewrite._states import DeferState, StateTag
from prophet_jax._values._network import Pressure
from prophet_jax._values._tree import layer_of
from prophet_jax.cli import main

ROOT = Path(__file__).resolve().parents[1]
# the README and docs/, where its longer parts moved (docs/usage.md, docs/gpu.md)
README = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
AX = "dp"
NDEV = 8


@dataclass(frozen=True)
class Expect:
  kind: str                      # 'raises', 'warns', 'ok'
  exc: Any = None
  words: tuple[str, ...] = ()
  check: Callable[[Any], bool] | None = None


def raises(exc, *words):
  return Expect("raises", exc, words)


def warns(cat, *words):
  return Expect("warns", cat, words)


def ok(check=lambda _: True):
  return Expect("ok", check=check)


# -- shared values ---------------------------------------------------------------------------------

ROW = dict(path="a/w", layer="a", shape=(4,), dtype="float32", nbytes=16, ready_s=0.1)
PROFILE = GradientProfile.from_rows([ROW, dict(ROW, path="b/w", layer="b", ready_s=0.05)],
                                    forward_s=0.1, backward_s=0.1)
NET = NetworkModel.preset("10gbe", workers=8)
SCHED = pj.plan(PROFILE, NET, "wfbp")
SCHED_JSON = json.loads(SCHED.to_json())
DEAR = pj.plan(PROFILE, NET, "dear")
DEAR_JSON = json.loads(DEAR.to_json())
NET_KW = dict(alpha_s=1e-6, beta_s_per_byte=1e-9, workers=4)
ISSUE_PRESSURE = Pressure(background_flows=0.3, tail_prob=0.002, tail_scale_s=0.005)


def row(**kw):
  return lambda: GradientProfile.from_rows([dict(ROW, **kw)], forward_s=0.1, backward_s=0.1)


def sched_json(**kw):
  return lambda: Schedule.from_json({**SCHED_JSON, **kw})


def net_json(**kw):
  return lambda: NetworkModel.from_json(json.dumps({**NET_KW, **kw}))


def _issue_cell():
  from prophet_jax.models import load_trace

  p = load_trace("resnet50-v100")
  net = NetworkModel.preset("25gbe", workers=64).replace(pressure=ISSUE_PRESSURE)
  t = {name: pj.simulate(pj.plan(p, net, name, **({"max_defer": 0.1} if name == "dlcp" else {})), p, net,
                         events=False).iteration_s
       for name in ("auto", "bucket", "dlcp")}
  return t


def _bench_baselines():
  import ast

  src = (ROOT / "bench" / "dlcp.py").read_text()
  node = next(n for n in ast.parse(src).body if isinstance(n, ast.Assign)
              and getattr(n.targets[0], "id", "") == "BASELINES")
  return ast.literal_eval(node.value)


def _bad_scheduler(profile, network):  # no cross_step keyword
  return SCHED


# -- jax rows: a tiny tree, traced only ------------------------------------------------------------

TREE = {"a": {"w": jnp.ones((4, 3))}, "b": {"w": jnp.ones((3,))}}
TPROF = GradientProfile.from_params(TREE, forward_s=1e-3, backward_s=2e-3)
TSCHED = pj.plan(TPROF, NET, "wfbp")
X = jnp.ones((NDEV, 2, 4))


def _tloss(p, x):
  return jnp.mean((x @ p["a"]["w"] + p["b"]["w"]) ** 2)


def _pmap_update(tx, state_fn=None):
  def step(x):
    g = jax.grad(_tloss)(TREE, x)
    st = tx.init(TREE) if state_fn is None else state_fn()
    return tx.update(g, st, TREE)[0]
  return jax.eval_shape(jax.pmap(step, axis_name=AX), X)


def _hooked_aux():
  g = pj.hooked(lambda p, x: (_tloss(p, x), {"n": 1.0}), TSCHED, axis_name=AX)
  return jax.eval_shape(jax.pmap(lambda x: g(TREE, x), axis_name=AX), X)


def _hooked_vector_loss():
  g = pj.hooked(lambda p, x: x @ p["a"]["w"], TSCHED, axis_name=AX)
  return jax.eval_shape(jax.pmap(lambda x: g(TREE, x), axis_name=AX), X)


def _hooked_pcast():
  g = pj.hooked(_tloss, TSCHED, axis_name=AX)
  mesh = jax.make_mesh((NDEV,), (AX,))

  def body(p, x):
    _, grads = g(jax.lax.pcast(p, AX, to="varying"), x[0])   # the README's scheduled line, kept
    return grads

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(AX)), out_specs=P())).trace(
      TREE, jax.ShapeDtypeStruct(X.shape, X.dtype, sharding=jax.sharding.NamedSharding(mesh, P(AX))))


def _deferring_tree_schedule():
  a, b = 0, 1
  rows = TPROF.tree_rows()
  ch = lambda *s: pj.Chunk(slices=s, dtype="float32")  # noqa: E731
  return Schedule(buckets=(pj.Bucket(chunks=(ch((a, 0, 6)), ch((a, 6, 12))), defer=1),
                           pj.Bucket(chunks=(ch((b, 0, 3)),))), rows=rows)


def _carry_to_lossless(convert=True):
  """I4: the old deferring state converted for the new lossless plan: its first step gives (reduced,
  None); unconverted, the step names convert_state."""
  d = _deferring_tree_schedule()
  st = pj.defer_state(d)
  g = jax.tree.map(lambda x: jnp.ones((NDEV, *x.shape)), TREE)
  rep = jax.tree.map(lambda x: jnp.broadcast_to(x, (NDEV, *x.shape)), st)
  if convert:
    rep = pj.convert_state(rep, TREE, TSCHED)
  return jax.pmap(lambda g, s: pj.allreduce(g, TSCHED, AX, defer_state=s), axis_name=AX)(g, rep)


def _bare_state_to_lossless():
  st = pj.defer_state(_deferring_tree_schedule())
  from prophet_jax._rewrite import _states

  bare = st._replace(tag=_states.StateTag(st.tag.key, st.tag.fingerprint, st.tag.layout))
  rep = jax.tree.map(lambda x: jnp.broadcast_to(x, (NDEV, *x.shape)), bare)
  g = jax.tree.map(lambda x: jnp.ones((NDEV, *x.shape)), TREE)
  return jax.eval_shape(jax.pmap(lambda g, s: pj.allreduce(g, TSCHED, AX, defer_state=s), axis_name=AX), g, rep)


def _replicated_residual_under_check_vma():
  d = _deferring_tree_schedule()
  tx = pj.scheduled(optax.sgd(0.1), d, axis_name=AX)
  mesh = jax.make_mesh((NDEV,), (AX,))

  def body(p, opt, x):
    g = jax.grad(_tloss)(jax.lax.pcast(p, AX, to="varying"), x[0])
    return tx.update(g, opt, p)[0]

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(AX)), out_specs=P())).trace(
      TREE, tx.init(TREE),
      jax.ShapeDtypeStruct(X.shape, X.dtype, sharding=jax.sharding.NamedSharding(mesh, P(AX))))


# -- issue 35: the library's own words where jax's were ---------------------------------------------

TDEAR = pj.plan(TPROF, NET, "dear")


def _hooked_dear_with_a_plain_tx():
  g = pj.hooked(_tloss, TDEAR, axis_name=AX)
  tx = optax.sgd(0.1, momentum=0.9)

  def step(x):
    _, shards = g(TREE, x)
    return tx.update(shards, tx.init(TREE), TREE)[0]

  return jax.eval_shape(jax.pmap(step, axis_name=AX), X)


def _host_batch_to_the_mesh_grad_fn():
  mesh = jax.make_mesh((NDEV,), (AX,))
  g = pj.hooked(_tloss, TSCHED, axis_name=AX, mesh=mesh)
  return g(jax.device_put(TREE, jax.sharding.NamedSharding(mesh, P())), np.ones((2 * NDEV, 4), np.float32))


def _state_of_another_schedule(kind):
  """A step's shard_map built for one schedule's state, given another's: jax rejects it before any
  library code runs; its message must carry the tag's own words."""
  from prophet_jax._rewrite import _zero

  mesh = jax.make_mesh((NDEV,), (AX,))
  if kind == "dear":
    make = lambda s: _zero.ShardedState(per_device=(jnp.zeros((NDEV, 2)),), tag=_zero.shard_tag(s, NDEV, "elementwise"))  # noqa: E731
    a, b = make(TDEAR), make(pj.plan(TPROF, NET.replace(workers=4), "dear", bucket_bytes=8))
  else:
    a, b = pj.defer_state(_deferring_tree_schedule()), pj.defer_state(_deferring_tree_schedule_2())
    a, b = (jax.tree.map(lambda x: jnp.broadcast_to(x, (NDEV,) + x.shape[1:]) if x.ndim == 3 else x, s)
            for s in (a, b))
  specs = pj.state_specs(a, AX)
  return jax.eval_shape(jax.shard_map(lambda s: 0.0, mesh=mesh, in_specs=(specs,), out_specs=P()), b)


def _deferring_tree_schedule_2():
  rows = TPROF.tree_rows()
  ch = lambda *s: pj.Chunk(slices=s, dtype="float32")  # noqa: E731
  return Schedule(buckets=(pj.Bucket(chunks=(ch((0, 0, 4)), ch((0, 4, 12))), defer=1),
                           pj.Bucket(chunks=(ch((1, 0, 3)),))), rows=rows)


CASES: list[tuple[str, Callable[[], Any], Expect]] = [
    # ---- issue 29, silent -------------------------------------------------------------------------
    # I1-I3: planning for the pressured network (more cells: tests/test_pressure.py)
    ("I1 auto under pressure vs bucket", _issue_cell, ok(lambda t: t["auto"] <= t["bucket"] * (1 + 1e-12))),
    ("I2 dlcp starts from the pressured plan", _issue_cell, ok(lambda t: t["dlcp"] <= t["bucket"] * (1 + 1e-12))),
    ("I3 bench compares bucket and xla too", _bench_baselines,
     ok(lambda b: {"wfbp", "bucket", "xla", "mgwfbp", "priority", "prophet", "auto"} <= set(b))),
    # I4-I7: deferred residuals across a re-plan (conservation: tests/test_replan.py)
    ("I4 old state converted to a new lossless plan", _carry_to_lossless,
     ok(lambda r: r[1] is None and float(np.asarray(r[0]["a"]["w"]).sum()) > 0)),
    ("I4b old state given unconverted names convert_state", lambda: _carry_to_lossless(False),
     raises(pj.ScheduleMismatchError, "convert_state")),
    ("I5 a state that cannot be carried says how", _bare_state_to_lossless,
     raises(TypeError, "cannot be carried over", "convert_state", "deferred_grads(state, params)")),
    ("I6 a way to take the residual out", lambda: pj.deferred_grads(
        pj.scheduled(optax.sgd(0.1), _deferring_tree_schedule(), axis_name=AX).init(TREE), TREE),
     ok(lambda t: jax.tree.structure(t) == jax.tree.structure(TREE))),
    ("I7 a replicated residual under check_vma", _replicated_residual_under_check_vma,
     raises(ValueError, "replicated over axis 'dp'", "state_specs")),
    ("I8 check_vma=False documented in the README", lambda: README,
     ok(lambda r: "check_vma=False" in r and "cannot see" in r)),
    # I9-I19: strings read as booleans, strict values
    ("I9 NetworkModel(overlap='no')", lambda: NetworkModel(**NET_KW, overlap="no"),
     raises(NetworkError, "overlap='no'", "True or False")),
    ("I10 network JSON overlap 'false'", net_json(overlap="false"),
     raises(NetworkError, "overlap='false'", "JSON true or false")),
    ("I11 schedule JSON cross_step 'false'", sched_json(cross_step="false"),
     raises(ScheduleError, "cross_step='false'", "True or False")),
    ("I12 schedule JSON predicted_s 'fast'", sched_json(predicted_s="fast"),
     raises(ScheduleError, "predicted_s='fast'", "finite number")),
    ("I13 schedule JSON predicted_s -1", sched_json(predicted_s=-1), raises(ScheduleError, "predicted_s=-1")),
    ("I14 row dtype int32", row(dtype="int32"), raises(ProfileError, "'a/w'", "dtype='int32'", "floating")),
    ("I15 row shape (2.5,)", row(shape=(2.5,)), raises(ProfileError, "shape=(2.5,)", "integer")),
    ("I16 row shape '44'", row(shape="44"), raises(ProfileError, "shape='44'", "list (or tuple) of integers")),
    ("I17 row layer None", row(layer=None), raises(ProfileError, "layer=None", "non-empty string")),
    ("I18 from_params layer_depth=0", lambda: GradientProfile.from_params(TREE, layer_depth=0),
     raises(ValueError, "layer_depth=0", ">= 1")),
    ("I19 fit on falling times", lambda: NetworkModel.fit([1e3, 1e4, 1e5, 1e6], [1e-3, 8e-4, 5e-4, 2e-4],
                                                         workers=4),
     warns(UserWarning, "NetworkModel.fit", "beta was clipped to 0", "fall as the size grows")),
    ("I20 fit with a large residual", lambda: NetworkModel.fit([1e3, 1e4, 1e5, 1e6],
                                                               [1e-3, 1e-5, 5e-3, 1e-4], workers=4),
     warns(UserWarning, "NetworkModel.fit", "RMS residual")),
    # ---- issue 29, crashes and misleading errors --------------------------------------------------
    ("I21 measure_network(0)", lambda: pj.measure_network(0),
     raises(NetworkError, "num_devices=0", "at least 2 devices")),
    ("I22 tx.update(grads, None)",
     lambda: _pmap_update(pj.scheduled(optax.sgd(0.1), TSCHED, axis_name=AX), lambda: None),
     raises(TypeError, "state=None", "tx.init(params)")),
    ("I23 NetworkModel(alpha_s=np.float32(1e-6))",
     lambda: NetworkModel(alpha_s=np.float32(1e-6), beta_s_per_byte=1e-9, workers=4),
     ok(lambda n: n.alpha_s > 0)),
    ("I24 optax.masked(scheduled) taking leaves away",
     lambda: _pmap_update(optax.masked(pj.scheduled(optax.sgd(0.1), TSCHED, axis_name=AX),
                                       {"a": {"w": True}, "b": {"w": False}})),
     raises(pj.CompositionError, "optax.masked", "'b/w'", "the model did not change")),
    ("I25 optax.multi_transform with scheduled",
     lambda: _pmap_update(optax.multi_transform({"s": pj.scheduled(optax.sgd(0.1), TSCHED, axis_name=AX),
                                                 "o": optax.sgd(0.1)}, {"a": {"w": "s"}, "b": {"w": "o"}})),
     raises(pj.CompositionError, "multi_transform", "scheduled(optax.multi_transform")),
    ("I26 optax.masked identity mask works",
     lambda: _pmap_update(optax.masked(pj.scheduled(optax.sgd(0.1), TSCHED, axis_name=AX),
                                       {"a": {"w": True}, "b": {"w": True}})), ok()),
    ("I27 hooked (loss, aux) without has_aux", _hooked_aux, raises(TypeError, "has_aux=True")),
    ("I28 hooked with the pcast line kept", _hooked_pcast,
     raises(ValueError, "'a/w' already varies over axis 'dp'", "without the pcast")),
    ("I29 custom scheduler, wrong signature", lambda: pj.plan(PROFILE, NET, _bad_scheduler),
     raises(TypeError, "_bad_scheduler", "cross_step")),
    ("I30 from_params(backward_s=-1)", lambda: GradientProfile.from_params(TREE, backward_s=-1),
     raises(ValueError, "backward_s=-1", ">= 0")),
    ("I31 profile.scaled(-1)", lambda: PROFILE.scaled(-1), raises(ValueError, "scaled(compute=-1)", "> 0")),
    ("I32 row 'shape': null", lambda: GradientProfile.from_json(
        {"rows": [dict(ROW, shape=None)], "forward_s": 0.1, "backward_s": 0.1}),
     raises(ProfileError, "'a/w'", "shape=None")),
    ("I33 the README's GPU snippet defines step (run: tests/test_readme.py)", lambda: README,
     ok(lambda r: "def step(params, opt_state, batch)" in r)),
    ("I34 pip install from a checkout", lambda: README, ok(lambda r: "pip install -e '.[gpu-compile]'" in r)),
    # ---- beyond the issue --------------------------------------------------------------------------
    ("N1 workers=4.0", lambda: NetworkModel(alpha_s=1e-6, beta_s_per_byte=1e-9, workers=4.0),
     raises(NetworkError, "workers=4.0", "integer")),
    ("N2 workers=np.int64(4)", lambda: NetworkModel(alpha_s=1e-6, beta_s_per_byte=1e-9, workers=np.int64(4)),
     ok(lambda n: n.workers == 4 and type(n.workers) is int)),
    ("N3 name=3", lambda: NetworkModel(**NET_KW, name=3), raises(NetworkError, "name=3", "string")),
    ("N4 fit_residual_s='x'", lambda: NetworkModel(**NET_KW, fit_residual_s="x"),
     raises(NetworkError, "fit_residual_s='x'")),
    ("N5 alpha_s='1e-6'", lambda: NetworkModel(alpha_s="1e-6", beta_s_per_byte=1e-9, workers=4),
     raises(NetworkError, "alpha_s='1e-6'", "finite number")),
    ("N6 alpha_s=True", lambda: NetworkModel(alpha_s=True, beta_s_per_byte=1e-9, workers=4),
     raises(NetworkError, "alpha_s=True")),
    ("N7 links=0", lambda: NetworkModel(**NET_KW, links=0), raises(NetworkError, "links=0", ">= 1")),
    ("N8 algorithm='tree'", lambda: NetworkModel(**NET_KW, algorithm="tree"),
     raises(NetworkError, "algorithm='tree'", "ring")),
    ("N9 pressure as a dict", lambda: NetworkModel(**NET_KW, pressure={"tail_prob": 0.1}),
     raises(NetworkError, "pressure=", "Pressure")),
    ("N10 preset '10GbE'", lambda: NetworkModel.preset("10GbE", workers=4),
     raises(NetworkError, "'10GbE'", "10gbe")),
    ("N11 preset workers='4'", lambda: NetworkModel.preset("10gbe", workers="4"),
     raises(NetworkError, "workers='4'")),
    ("N12 preset overlap='no'", lambda: NetworkModel.preset("10gbe", workers=4, overlap="no"),
     raises(NetworkError, "overlap='no'")),
    ("N13 fit, lengths differ", lambda: NetworkModel.fit([1e3, 1e4], [1e-3], workers=4),
     raises(NetworkError, "2 sizes but 1 times")),
    ("N14 fit, one size", lambda: NetworkModel.fit([1e3, 1e3], [1e-3, 2e-3], workers=4),
     raises(NetworkError, "at least 2 distinct message sizes")),
    ("N15 fit, workers=1", lambda: NetworkModel.fit([1e3, 1e4], [1e-3, 2e-3], workers=1),
     raises(NetworkError, "workers=1")),
    ("N16 fit, overlap='no'", lambda: NetworkModel.fit([1e3, 1e4], [1e-3, 2e-3], workers=4, overlap="no"),
     raises(NetworkError, "overlap='no'")),
    ("N17 network JSON missing fields", lambda: NetworkModel.from_json('{"alpha_s": 1e-6}'),
     raises(NetworkError, "missing field(s)", "beta_s_per_byte", "workers")),
    ("N18 network JSON unknown field", net_json(bandwidth=1e9), raises(ValueError, "unknown field(s) ['bandwidth']")),
    ("N19 Pressure(tail_prob=np.float32)", lambda: Pressure(tail_prob=np.float32(0.01)),
     ok(lambda q: isinstance(q.tail_prob, float))),
    ("N20 Pressure(samples=2.5)", lambda: Pressure(samples=2.5), raises(NetworkError, "samples=2.5")),
    ("N21 Pressure(tail_prob=True)", lambda: Pressure(tail_prob=True), raises(NetworkError, "tail_prob=True")),
    ("N22 row ready_s='0.1'", row(ready_s="0.1"), raises(ProfileError, "ready_s='0.1'", "number of seconds")),
    ("N23 row ready_s=True", row(ready_s=True), raises(ProfileError, "ready_s=True")),
    ("N24 row nbytes='16'", row(nbytes="16"), raises(ProfileError, "nbytes='16'", "integer")),
    ("N25 row shape=[4.0]", row(shape=[4.0]), raises(ProfileError, "shape=[4.0]", "4.0 (float)")),
    ("N26 row shape=[True]", row(shape=[True]), raises(ProfileError, "True (bool)")),
    ("N27 row dtype bool", row(dtype="bool", nbytes=4), raises(ProfileError, "dtype='bool'", "floating")),
    ("N28 row dtype float0", row(dtype="float0", nbytes=0), raises(ProfileError, "dtype='float0'")),
    ("N29 row dtype 'notadtype'", row(dtype="notadtype"), raises(ProfileError, "'notadtype'", "not a dtype")),
    ("N30 row layer ''", row(layer=""), raises(ProfileError, "layer=''")),
    ("N31 row path ''", row(path=""), raises(ProfileError, "path=''")),
    ("N32 row unknown field", row(ready=0.1), raises(ProfileError, "unknown field(s) ['ready']")),
    ("N33 row missing field", lambda: GradientProfile.from_rows(
        [{k: v for k, v in ROW.items() if k != "nbytes"}], forward_s=0.1, backward_s=0.1),
     raises(ProfileError, "missing field(s) ['nbytes']")),
    ("N34 profile forward_s '0.1'", lambda: GradientProfile.from_rows([ROW], forward_s="0.1", backward_s=0.1),
     raises(ProfileError, "forward_s='0.1'")),
    ("N35 profile method 'guessed'", lambda: GradientProfile.from_rows([ROW], forward_s=0.1, backward_s=0.1,
                                                                       method="guessed"),
     raises(ProfileError, "method='guessed'", "measured")),
    ("N36 profile model=3", lambda: GradientProfile.from_rows([ROW], forward_s=0.1, backward_s=0.1, model=3),
     raises(ProfileError, "model=3", "string")),
    ("N37 from_rows('abc')", lambda: GradientProfile.from_rows("abc", forward_s=0.1, backward_s=0.1),
     raises(ProfileError, "rows must be a list")),
    ("N38 from_rows([3])", lambda: GradientProfile.from_rows([3], forward_s=0.1, backward_s=0.1),
     raises(ProfileError, "profile row 0 is 3")),
    ("N39 profile JSON rows {}", lambda: GradientProfile.from_json({"rows": {}, "forward_s": 0.1,
                                                                   "backward_s": 0.1}),
     raises(ProfileError, "'rows' must be a list")),
    ("N40 from_params layer_depth=-1", lambda: GradientProfile.from_params(TREE, layer_depth=-1),
     raises(ValueError, "layer_depth=-1")),
    ("N41 from_params layer_depth=1.5", lambda: GradientProfile.from_params(TREE, layer_depth=1.5),
     raises(TypeError, "layer_depth=1.5", "integer")),
    ("N42 from_params forward_s='x'", lambda: GradientProfile.from_params(TREE, forward_s="x"),
     raises(ValueError, "forward_s='x'")),
    ("N43 from_params of an int tree", lambda: GradientProfile.from_params({"n": np.zeros(3, np.int32)}),
     raises(ProfileError, "no floating-point leaves")),
    ("N44 scaled('2')", lambda: PROFILE.scaled("2"), raises(ValueError, "compute='2'")),
    ("N45 scaled(nan)", lambda: PROFILE.scaled(float("nan")), raises(ValueError, "compute=nan")),
    ("N46 scaled(0)", lambda: PROFILE.scaled(0), raises(ValueError, "compute=0")),
    ("N47 scaled(np.float32(2))", lambda: PROFILE.scaled(np.float32(2)),
     ok(lambda p: p.backward_s == pytest.approx(0.2))),
    ("N48 schedule policy=3", sched_json(policy=3), raises(ScheduleError, "policy=3")),
    ("N49 schedule cross_step=1", sched_json(cross_step=1), raises(ScheduleError, "cross_step=1")),
    ("N50 schedule predicted_s NaN", lambda: Schedule.from_json(
        SCHED.to_json().replace('"predicted_s": ' + json.dumps(SCHED.predicted_s), '"predicted_s": NaN')),
     raises(ScheduleError, "predicted_s=nan")),
    ("N51 schedule row shape not a list", sched_json(rows=[["a/w", "4", "float32"], SCHED_JSON["rows"][1]]),
     raises(ScheduleError, "row 0", "shape '4'")),
    ("N52 schedule chunk without dtype", sched_json(buckets=[[{"slices": [[0, 0, 4]]}], SCHED_JSON["buckets"][1]]),
     raises(ScheduleError, "bucket 0, chunk 0", "'dtype' and 'slices'")),
    ("N53 schedule bucket not a list", sched_json(buckets=[7, SCHED_JSON["buckets"][1]]),
     raises(ScheduleError, "bucket 0 is 7")),
    ("N54 schedule JSON without buckets", lambda: Schedule.from_json({"rows": SCHED_JSON["rows"]}),
     raises(ScheduleError, "missing field(s) ['buckets']")),
    ("N55 Chunk dtype int32", lambda: pj.Chunk(slices=((0, 0, 4),), dtype="int32"),
     raises(ScheduleError, "dtype='int32'", "floating")),
    ("N56 Chunk slice of floats", lambda: pj.Chunk(slices=((0, 0.0, 4),), dtype="float32"),
     raises(ScheduleError, "(0, 0.0, 4)", "three integers")),
    ("N57 Bucket defer=True", lambda: pj.Bucket(chunks=(pj.Chunk(slices=((0, 0, 4),), dtype="float32"),),
                                                defer=True),
     raises(ScheduleError, "defer=True", "integer")),
    ("N58 Bucket of non-chunks", lambda: pj.Bucket(chunks=((0, 0, 4),)), raises(ScheduleError, "prophet_jax.Chunk")),
    ("N59 plan cross_step='false'", lambda: pj.plan(PROFILE, NET, "wfbp", cross_step="false"),
     raises(ValueError, "cross_step='false'", "True, False or 'auto'")),
    ("N60 plan cross_step=np.True_", lambda: pj.plan(PROFILE, NET, "wfbp", cross_step=np.True_),
     ok(lambda s: s.cross_step is True)),
    ("N61 simulate cross_step=1", lambda: pj.simulate(SCHED, PROFILE, NET, cross_step=1),
     raises(TypeError, "cross_step=1", "True or False")),
    ("N62 plan policy=3", lambda: pj.plan(PROFILE, NET, 3), raises(TypeError, "policy=3", "name")),
    ("N63 plan unknown option", lambda: pj.plan(PROFILE, NET, "bucket", foo=1),
     raises(TypeError, "unknown option(s) ['foo']", "bucket_bytes")),
    ("N64 bucket_bytes=np.int64", lambda: pj.plan(PROFILE, NET, "bucket", bucket_bytes=np.int64(1024)), ok()),
    ("N65 dlcp max_defer=np.float32", lambda: pj.plan(PROFILE, NET, "dlcp", max_defer=np.float32(0.1)), ok()),
    ("N66 lower_bound max_defer='0.1'", lambda: pj.lower_bound(PROFILE, NET, max_defer="0.1"),
     raises(ValueError, "max_defer='0.1'")),
    ("N67 a Scheduler returning None", lambda: pj.plan(PROFILE, NET, lambda p, n, *, cross_step: None),
     raises(TypeError, "returned NoneType", "not a Schedule")),
    ("N68 plan with a dict as the profile", lambda: pj.plan({"rows": []}, NET),
     raises(TypeError, "`profile` must be a prophet_jax.GradientProfile")),
    ("N69 simulate another profile's schedule", lambda: pj.simulate(
        SCHED, GradientProfile.from_rows([dict(ROW, path="c/w")], forward_s=0.1, backward_s=0.1), NET),
     raises(ScheduleMismatchError, "simulate()")),
    ("N70 layer_of layer_depth=0", lambda: layer_of("a/b/c", 0), raises(ValueError, "layer_depth=0")),
    ("N71 measure_network(2.0)", lambda: pj.measure_network(2.0), raises(TypeError, "num_devices=2.0", "integer")),
    ("N72 measure_network(64)", lambda: pj.measure_network(64), raises(NetworkError, "num_devices=64")),
    ("N73 hooked of a vector loss", _hooked_vector_loss, raises(TypeError, "real floating scalar", "(2, 3)")),
    ("N74 scheduled(tx=3)", lambda: pj.scheduled(3, TSCHED, axis_name=AX), raises(TypeError, "`tx` must be")),
    ("N75 hooked(has_aux='yes')", lambda: pj.hooked(_tloss, TSCHED, axis_name=AX, has_aux="yes"),
     raises(TypeError, "has_aux='yes'")),
    ("N76 scheduled(axis_name='')", lambda: pj.scheduled(optax.sgd(0.1), TSCHED, axis_name=""),
     raises(TypeError, "axis_name")),
    ("N77 deferred_grads of a state with no schedule", lambda: pj.deferred_grads(
        DeferState(*pj.defer_state(_deferring_tree_schedule())[:4], tag=StateTag("k", "f", ())), TREE),
     raises(ValueError, "schedule=the_old_schedule")),
    ("N78 deferred_grads of a lossless state", lambda: pj.deferred_grads(None, TREE),
     ok(lambda t: not any(np.asarray(x).any() for x in jax.tree.leaves(t)))),
    # the sharded schedules merged from issue 28 (dear, Schedule.gathers)
    ("N89 shard_nbytes('64')", lambda: DEAR.shard_nbytes("64"), raises(TypeError, "workers='64'", "integer >= 1")),
    ("N90 shard_nbytes(0)", lambda: DEAR.shard_nbytes(0), raises(ValueError, "workers=0", "integer >= 1")),
    ("N91 padded_sizes(True)", lambda: DEAR.padded_sizes(True), raises(TypeError, "workers=True")),
    ("N92 shard_nbytes(np.int64(8))", lambda: DEAR.shard_nbytes(np.int64(8)), ok(lambda n: n == sum(-(-c.size // 8) * 4 for c in DEAR.chunks))),
    ("N93 schedule JSON gathers of strings", lambda: Schedule.from_json(dict(DEAR_JSON, gathers=[["0"]])),
     raises(ScheduleError, "gather 0", "chunk indices")),
    ("N94 auto(sharded='yes')", lambda: pj.plan(PROFILE, NET, "auto", sharded="yes"),
     raises(TypeError, "sharded='yes'", "True or False")),
    ("N95 dear(bucket_bytes='25')", lambda: pj.plan(PROFILE, NET, "dear", bucket_bytes="25"),
     raises(TypeError, "bucket_bytes='25'")),
    ("N96 dear on two links", lambda: pj.plan(PROFILE, NET.replace(links=2), "dear"),
     raises(ValueError, "links=2", "links=1")),
    # ---- issue 35: opaque errors made the library's (the rest: tests/test_containers.py,
    # tests/test_global_decisions.py, tests/test_reduction.py) ----------------------------------------
    ("J1 hooked(dear) paired with a plain optax tx", _hooked_dear_with_a_plain_tx,
     raises(ValueError, "prophet_jax.GradShards", "wrap tx in prophet_jax.scheduled")),
    ("J2 a host batch to hooked(mesh=)'s grad_fn", _host_batch_to_the_mesh_grad_fn,
     raises(ValueError, "batch leaf 'batch'", "host data", "jax.device_put(batch, NamedSharding(mesh, P('dp')))")),
    ("J3 a sharded state of another schedule to a compiled step", lambda: _state_of_another_schedule("dear"),
     raises(ValueError, "optimizer state of a sharded (dear, ZeRO-1) plan", "unshard_state")),
    ("J4 a deferral state of another schedule to a compiled step", lambda: _state_of_another_schedule("dlcp"),
     raises(ValueError, "deferral state of a deferring (dlcp) plan", "deferred_grads")),
    ("J5 hooked(reduction='avg')", lambda: pj.hooked(_tloss, TSCHED, axis_name=AX, reduction="avg"),
     raises(ValueError, "reduction='avg'", "'sum'")),
    ("J6 scheduled(sm3, dear).init", lambda: jax.eval_shape(jax.pmap(
        pj.scheduled(optax.sm3(0.1), TDEAR, axis_name=AX).init, axis_name=AX), jax.tree.map(
            lambda x: jnp.broadcast_to(x, (NDEV,) + x.shape), TREE)),
     raises(pj.ShardingError, "scale_by_sm3", "IndexError")),
]


@pytest.mark.parametrize("name, make, expect", CASES, ids=[c[0].split(" ")[0] for c in CASES])
def test_bad_input(name, make, expect):
  if expect.kind == "raises":
    with pytest.raises(expect.exc) as e:
      make()
    text = str(e.value)
    for w in expect.words:
      assert w in text, f"{name}: {w!r} not in the message: {text}"
  elif expect.kind == "warns":
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      make()
    texts = [str(w.message) for w in caught if issubclass(w.category, expect.exc)]
    assert texts, f"{name}: no {expect.exc.__name__}"
    assert any(all(w in t for w in expect.words) for t in texts), f"{name}: {texts}"
  else:
    result = make()
    assert expect.check(result), f"{name}: {result!r:.200}"


def test_the_table_holds_the_issue_rows_and_more():
  issue = [c for c in CASES if c[0].startswith("I")]
  assert len(issue) >= 34 and len(CASES) - len(issue) >= 50


# -- the command line: one line naming the file or flag and the fix, exit 2 ---------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp("cli")
  out = {"list": "[]", "string": '"abc"', "number": "42",
         "overlap": json.dumps({**NET_KW, "overlap": "false"}),
         "badpressure": json.dumps({**NET_KW, "pressure": {"tail_prob": 2}}),
         "intprofile": json.dumps({"rows": [dict(ROW, dtype="int32")], "forward_s": 0.1, "backward_s": 0.1}),
         "profile": PROFILE.to_json(), "net": NET.to_json()}
  paths = {}
  for k, v in out.items():
    paths[k] = d / f"{k}.json"
    paths[k].write_text(v)
  paths["dir"] = d
  return {k: str(v) for k, v in paths.items()}


CLI = [
    # issue 29
    ("I35 simulate --network []", ["simulate", "--model", "resnet50", "--network", "{list}"],
     ["--network", "list.json", "JSON list", "NetworkModel"]),
    ("I36 plan --profile []", ["plan", "--profile", "{list}", "--network", "10gbe", "--workers", "4",
                               "--out", "{dir}/s.json"], ["--profile", "JSON list", "GradientProfile"]),
    ("I37 audit --schedule []", ["audit", "--schedule", "{list}"], ["--schedule", "JSON list", "Schedule"]),
    ("I38 a file holding a JSON string", ["simulate", "--model", "resnet50", "--network", "{string}",
                                          "--workers", "4"], ["JSON string", "not a JSON object"]),
    ("I39 network JSON overlap 'false'", ["simulate", "--model", "resnet50", "--network", "{overlap}"],
     ["--network", "overlap.json", "overlap='false'"]),
    ("I40 plan --out over its --profile", ["plan", "--profile", "{profile}", "--network", "10gbe",
                                           "--workers", "4", "--out", "{profile}"],
     ["--out", "input of --profile", "another path"]),
    ("I41 audit --xla-option xla_no_such_flag=1", ["audit", "--model", "mlp", "--policy", "wfbp",
                                                   "--xla-option", "xla_no_such_flag=1"],
     ["--xla-option xla_no_such_flag=1", "XLA refused it"]),
    # beyond the issue
    ("N79 --model of a file holding a number", ["simulate", "--model", "{number}", "--network", "10gbe",
                                                "--workers", "4"], ["--model", "JSON number"]),
    ("N80 network file with a bad pressure", ["simulate", "--model", "resnet50", "--network", "{badpressure}"],
     ["--network", "tail_prob=2"]),
    ("N81 a profile row of int32", ["plan", "--profile", "{intprofile}", "--network", "10gbe", "--workers",
                                    "4", "--out", "{dir}/s.json"], ["--profile", "intprofile.json", "int32"]),
    ("N82 --network a directory", ["simulate", "--model", "resnet50", "--network", "{dir}", "--workers", "4"],
     ["--network", "is a directory"]),
    ("N83 --timeline over its --model", ["simulate", "--model", "{profile}", "--network", "10gbe",
                                         "--workers", "4", "--timeline", "{profile}"],
     ["--timeline", "input of --model"]),
    ("N84 a missing required flag", ["simulate", "--model", "resnet50"], ["--network", "--help"]),
    ("N85 an unknown flag", ["simulate", "--model", "resnet50", "--network", "10gbe", "--wrokers", "4"],
     ["unrecognized arguments: --wrokers"]),
    ("N86 --workers 0", ["simulate", "--model", "resnet50", "--network", "10gbe", "--workers", "0"],
     ["--workers", "positive integer"]),
    ("N87 --max-defer for auto", ["plan", "--profile", "{profile}", "--network", "{net}", "--max-defer",
                                  "0.1", "--out", "{dir}/s2.json"], ["--max-defer", "'dlcp'"]),
    ("N88 --pressure garbage", ["simulate", "--model", "resnet50", "--network", "10gbe", "--workers", "4",
                                "--pressure", "heavy"], ["--pressure", "NAME=VALUE"]),
]


@pytest.mark.parametrize("name, argv, words", CLI, ids=[c[0].split(" ")[0] for c in CLI])
def test_cli_error_is_one_line_exit_2(capsys, files, name, argv, words):
  argv = [a.format(**files) for a in argv]
  try:
    code = main(argv)
  except SystemExit as e:   # argparse's own errors
    code = e.code
  _, err = capsys.readouterr()
  lines = [x for x in err.strip().splitlines() if x.strip()]
  assert code == 2, (name, err)
  assert len(lines) == 1, (name, err)
  for w in words:
    assert w in err, f"{name}: {w!r} not in {err!r}"
  if name.startswith("I40"):
    assert GradientProfile.from_json(Path(files["profile"]).read_text()) == PROFILE   # the input survived
