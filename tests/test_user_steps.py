"""The user-setup matrix: the setups of tests/_user_setups.py x {scheduled, hooked, pipelined} x {pmap,
shard_map} (a pairwise cover: every setup with every API, and every setup and API under both mappings),
against the setup's reference (the single-device full batch, or the plain pmean step where that is the
right one: see _user_setups.py), with docs/design.md's tolerance, on multi-chunk schedules.

Each case runs STEPS steps the way a user would (host batches placed on the devices, the user's own
`jax.pmap` or `jax.jit(jax.shard_map(...))`), then compares the parameters (and the model state) with
the reference's, and each step's loss (mean over devices) and aux (summed over devices) with the
reference step's on the same batch. The negative control runs the same compiled step of every case with
the gradient mean taken over n-1 devices (a 14% scale, injected into the chunked reduction through the
engine's test seam and a runtime scalar: with 1 it is the library's own division by n, exactly) and
checks that the comparison fails for every case, bfloat16 included.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import _user_setups as U
import prophet_jax as pj
from _assert import assert_trees_close
from prophet_jax._rewrite._collectives import engine_hooks

AXIS = "data"
APIS = ("scheduled", "hooked", "pipelined")
MAPPINGS = ("pmap", "shard_map")
WRONG_SCALE = U.N_DEV / (U.N_DEV - 1)  # the negative control: the chunked reductions divide by n - 1


# --------------------------------------------------------------------------------------------------
# placing values on the devices (typed PRNG keys go through their key data)


def _is_key(x) -> bool:
  return jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key)


def _host(x):
  """A leaf as host data: numpy, or a typed key array kept as it is."""
  return x if _is_key(x) else np.asarray(x)


@functools.cache
def _mesh():
  return jax.make_mesh((U.N_DEV,), (AXIS,))


@functools.cache
def _pmap_sharding():
  return NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:U.N_DEV]), (AXIS,)), P(AXIS))


def _replicate(tree):
  def rep(x):
    x = _host(x)
    if _is_key(x):
      data = jax.random.key_data(x)
      return jax.random.wrap_key_data(jnp.broadcast_to(data, (U.N_DEV, *data.shape)))
    return np.broadcast_to(x, (U.N_DEV, *x.shape))
  return jax.device_put(jax.tree.map(rep, tree), _pmap_sharding())


def _split(batch):
  return jax.device_put(jax.tree.map(lambda x: _host(x).reshape(U.N_DEV, -1, *x.shape[1:]), batch),
                        _pmap_sharding())


def _put(tree, spec):
  return jax.device_put(jax.tree.map(_host, tree), NamedSharding(_mesh(), spec))


def _first(tree):
  """Replicated pmap outputs -> one copy."""
  return jax.tree.map(lambda x: x[0], tree)


def _pcast(params):
  return jax.tree.map(lambda x: jax.lax.pcast(x, AXIS, to="varying"), params)


def _scaled(fn):
  """fn(*args) -> fn(*args, scale): traced with every chunked reduction dividing by n / scale, `scale` a
  runtime scalar (the engine's test seam, `engine_hooks`): 1 is the library's own division, exactly;
  WRONG_SCALE divides by n - 1. One compiled step serves the case and its negative control."""

  def scaled(*args):
    *args, scale = args
    with engine_hooks(divisor=lambda n: n / scale):
      return fn(*args)

  return scaled


# --------------------------------------------------------------------------------------------------
# the steps a user writes


def _plain_body(s: U.Setup, api: str, mapping: str, schedule: pj.Schedule):
  """The per-device body of a one-call step: grads (reduced by `api`), update. api: 'scheduled',
  'hooked' or 'pmean' (the plain reference)."""
  base = s.make_tx()
  tx = pj.scheduled(base, schedule, axis_name=AXIS) if api == "scheduled" else base
  grad_fn = pj.hooked(s.loss_fn, schedule, axis_name=AXIS, has_aux=s.has_aux or s.has_state)

  def body(p, o, ms, b):
    if api == "hooked":
      value, g = grad_fn(p, *((ms, b) if s.has_state else (b,)))
      loss, out = value if (s.has_aux or s.has_state) else (value, None)
    else:
      (loss, out), g = U.value_and_grad(s, _pcast(p) if mapping == "shard_map" else p, ms, b)
      if api == "pmean":
        g = jax.lax.pmean(g, AXIS)
    u, o = tx.update(g, o, p)
    ms, aux = (out, None) if s.has_state else (ms, out)
    return optax.apply_updates(p, u), o, ms, loss, aux

  return tx, body


def plain_runner(s: U.Setup, api: str, mapping: str, schedule: pj.Schedule):
  """scale -> STEPS one-call steps of one compiled step: (params, model_state, [(per-device losses,
  per-device aux)])."""
  tx, body = _plain_body(s, api, mapping, schedule)
  opt = tx.init(s.params)
  if mapping == "pmap":
    f = jax.pmap(_scaled(body), axis_name=AXIS, in_axes=(0, 0, 0, 0, None))
    p0, o0, ms0 = _replicate(s.params), _replicate(opt), _replicate(s.model_state)
    place, fetch = _split, _first
  else:
    def sm_body(p, o, ms, b):
      p, o, ms, loss, aux = body(p, o, ms, b)
      return p, o, ms, loss[None], jax.tree.map(lambda a: a[None], aux)

    f = jax.jit(jax.shard_map(_scaled(sm_body), mesh=_mesh(), in_specs=(P(), P(), P(), P(AXIS), P()),
                              out_specs=(P(), P(), P(), P(AXIS), P(AXIS))))
    p0, o0, ms0 = _put(s.params, P()), _put(opt, P()), _put(s.model_state, P())
    place, fetch = (lambda b: _put(b, P(AXIS))), (lambda t: t)

  def go(scale: float):
    p, o, ms, history = p0, o0, ms0, []
    for b in s.batches:
      p, o, ms, loss, aux = f(p, o, ms, place(b), jnp.float32(scale))
      history.append((np.asarray(loss), None if aux is None else np.asarray(aux)))
    return fetch(p), fetch(ms), history

  return go


def run_plain(s: U.Setup, api: str, mapping: str, schedule: pj.Schedule):
  """STEPS one-call steps: (params, model_state, [(per-device losses, per-device aux)])."""
  return plain_runner(s, api, mapping, schedule)(1.0)


def pipelined_runner(s: U.Setup, mapping: str, schedule: pj.Schedule):
  flags = {k: v for k, v in (("has_aux", s.has_aux), ("has_state", s.has_state)) if v}
  pipe = pj.pipelined(s.loss_fn, s.make_tx(), schedule, axis_name=AXIS, **flags)
  state0 = pipe.init(s.params, s.model_state) if s.has_state else pipe.init(s.params)

  def split_out(out):
    return out if s.has_aux else (out, None)

  if mapping == "pmap":
    step = jax.pmap(_scaled(lambda st, b: (lambda st2, out: (st2, *split_out(out)))(*pipe.step(st, b))),
                    axis_name=AXIS, in_axes=(0, 0, None))
    flush = jax.pmap(_scaled(pipe.flush), axis_name=AXIS, in_axes=(0, None))
    state0, place, fetch = _replicate(state0), _split, _first
  else:
    specs = pipe.state_specs()

    def body(st, b):
      st, out = pipe.step(st, b)
      loss, aux = split_out(out)
      return st, loss[None], jax.tree.map(lambda a: a[None], aux)

    step = jax.jit(jax.shard_map(_scaled(body), mesh=_mesh(), in_specs=(specs, P(AXIS), P()),
                                 out_specs=(specs, P(AXIS), P(AXIS))))
    flush = jax.jit(jax.shard_map(_scaled(pipe.flush), mesh=_mesh(), in_specs=(specs, P()), out_specs=specs))
    state0, place, fetch = _put(state0, P()), (lambda b: _put(b, P(AXIS))), (lambda t: t)

  def go(scale: float):
    state, history = state0, []
    for b in s.batches:
      state, loss, aux = step(state, place(b), jnp.float32(scale))
      history.append((np.asarray(loss), None if aux is None else np.asarray(aux)))
    state = flush(state, jnp.float32(scale))
    assert state.pending is None
    return fetch(state.params), fetch(state.model_state), history

  return go


@functools.cache
def runner(name: str, api: str, mapping: str):
  """scale -> the case's result; one compiled step (and flush) per case, cached."""
  s, schedule = U.setups()[name], U.schedule_for(name)
  if api == "pipelined":
    return pipelined_runner(s, mapping, schedule)
  return plain_runner(s, api, mapping, schedule)


@functools.cache
def cached_run(name: str, api: str, mapping: str):
  return runner(name, api, mapping)(1.0)


@functools.cache
def reference(name: str, mapping: str):
  """(params, model_state, [(mean loss, summed aux)]) of the setup's reference (mapping: for pmean)."""
  s = U.setups()[name]
  if s.reference == "single-device":
    p, ms, history = U.single_device_reference(name)
    return p, ms, [(float(loss), aux) for loss, aux in history]
  p, ms, history = run_plain(s, "pmean", mapping, U.schedule_for(name))
  return p, ms, [(float(np.mean(loss)), None if aux is None else np.sum(aux, 0)) for loss, aux in history]


# --------------------------------------------------------------------------------------------------
# the check


def check(name: str, mapping: str, got, *, params_only: bool = False) -> None:
  """The case's result equals the reference: params and model state within docs/design.md's tolerance, the
  losses and aux of each step. Raises AssertionError naming what differs."""
  s = U.setups()[name]
  p, ms, history = got
  ref_p, ref_ms, ref_history = reference(name, mapping)
  assert_trees_close(p, ref_p, s.params)
  if params_only:
    return
  if s.has_state:
    if _is_key(s.model_state):  # the key the plain loop holds after STEPS splits, exactly
      np.testing.assert_array_equal(jax.random.key_data(ms), jax.random.key_data(ref_ms))
    else:
      assert_trees_close(ms, ref_ms, s.model_state)
  for k, ((loss, aux), (ref_loss, ref_aux)) in enumerate(zip(history, ref_history)):
    np.testing.assert_allclose(np.mean(loss), ref_loss, rtol=2e-5, err_msg=f"loss of step {k}")
    if s.has_aux:  # the number of correct predictions, summed over the devices: the full batch's
      np.testing.assert_array_equal(np.sum(aux, 0), ref_aux, err_msg=f"aux of step {k}")


def cases() -> list[tuple[str, str, str]]:
  """A pairwise cover: every setup with every API, the mappings alternating so that every (setup,
  mapping) and (api, mapping) pair occurs too (checked below): 21 cases instead of 42, each
  compiled once."""
  out = []
  for k, name in enumerate(U.SETUP_NAMES):
    out += [(name, api, MAPPINGS[(k + j) % 2]) for j, api in enumerate(APIS)]
  return out


CASES = cases()


def test_cases_cover_every_pair():
  factors = (U.SETUP_NAMES, APIS, MAPPINGS)
  for i, j in ((0, 1), (0, 2), (1, 2)):
    want = {(a, b) for a in factors[i] for b in factors[j]}
    assert {(c[i], c[j]) for c in CASES} == want, (i, j)


@pytest.mark.parametrize("name,api,mapping", CASES)
def test_user_step_matches_reference(name, api, mapping):
  check(name, mapping, cached_run(name, api, mapping))


def test_setups_plan_several_chunks_and_clip_both_ways():
  for name in U.SETUP_NAMES:
    assert len(U.schedule_for(name).chunks) >= 3, (name, len(U.schedule_for(name).chunks))
  norms = U.gradient_norms("clip-adamw")  # clip_by_global_norm clips on some steps, not on others
  assert min(norms) < U.CLIP_NORM < max(norms), norms


# --------------------------------------------------------------------------------------------------
# the negative control


@pytest.mark.parametrize("name,api,mapping", CASES)
def test_a_14_percent_gradient_scale_fails_every_case(name, api, mapping):
  """The case's own compiled step, run with the chunked reductions dividing by n - 1, fails the check."""
  got = runner(name, api, mapping)(WRONG_SCALE)
  with pytest.raises(AssertionError, match=r"max\|got-ref\|"):  # the parameters themselves differ
    check(name, mapping, got, params_only=True)
