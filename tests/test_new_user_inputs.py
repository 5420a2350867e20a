"""Issue 46's trial: bad inputs a new user gives the surface added since the last round (choose, xla_options
and `prophet-jax xla-flags`, tag_plan/tag_layers, audit, profile_step, GpuTopology, the probe), each a
clear error naming the value and the fix, or the right result. Public API only; cheap (no step trains:
tiny jitted steps, error paths, compile-only targets). The counts by class before and after the fixes are
in the issue's closing note.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import prophet_jax as pj
from prophet_jax import cli

PARAMS = {"a": {"w": np.ones((16, 8), np.float32), "b": np.zeros((8,), np.float32)},
          "c": {"w": np.ones((8, 4), np.float32)}}
PROFILE = pj.GradientProfile.from_params(PARAMS, forward_s=1e-3, backward_s=2e-3)
NET = pj.NetworkModel.preset("10gbe", workers=8)
SLOW = pj.NetworkModel(workers=8, alpha_s=1e-6, beta_s_per_byte=1e-7)
WFBP = pj.plan(PROFILE, NET, "wfbp")
STATE = {"params": jnp.ones((8, 4), jnp.float32)}
BATCH = jnp.ones((8, 4), jnp.float32) * 0.5


def _fsdp():
  params = {f"l{i}": {"w": np.zeros((64, 64), np.float32), "b": np.zeros((64,), np.float32)} for i in range(3)}
  profile = pj.GradientProfile.from_params(params, forward_s=0.01, backward_s=0.02, mesh={"data": 8},
                                           shardings={f"l{i}": {"w": ("data", None), "b": None} for i in range(3)})
  return pj.plan(profile, NET, "fsdp")


def _lean():
  return jax.jit(lambda s, b: ({"params": s["params"] - 0.1 * s["params"] * b}, jnp.sum(s["params"] * b)))


def _loss(p, b):
  return jnp.mean((b @ p["a"]["w"] + p["a"]["b"]) @ p["c"]["w"])


def _tag_linen_module():
  import flax.linen as nn

  with pj.tag_layers(WFBP, model=nn.Dense(3)):
    pass


def _choose(steps, **kw):
  kw.setdefault("rounds", 6)
  return pj.choose(steps, kw.pop("state", STATE), kw.pop("batches", [BATCH]), control=kw.pop("control", _lean()),
                   **kw)


# name -> (call, exception type, regex of the message); each must raise that, clearly
RAISES = {
    "choose: steps a list": (lambda: _choose([_lean()]), TypeError, r"expected a mapping of names to step functions"),
    "choose: control None": (lambda: _choose({"a": _lean()}, control=None), TypeError,
                             r"choose\(control=...\): expected the control's step function"),
    "choose: one batch, not a list": (lambda: _choose({"a": _lean()}, batches=BATCH), TypeError,
                                      r"\[batch\] for one"),
    "choose: 3 rounds": (lambda: _choose({"a": _lean()}, rounds=3), ValueError, r"at least 6 rounds"),
    "choose: (loss, state) swapped": (lambda: _choose({"a": jax.jit(lambda s, b: _lean()(s, b)[::-1])}), TypeError,
                                      r"step 'a' returned a tuple.*`state, aux = step\(state, batch\)`"),
    "choose: a NaN batch": (lambda: _choose({"a": _lean()}, batches=[BATCH * jnp.nan]), ValueError,
                            r"step 'control' returned a non-finite loss \(nan\) on its call 1"),
    "choose: a step that does not train": (lambda: _choose({"idle": jax.jit(lambda s, b: (s, jnp.float32(0)))}),
                                           ValueError, r"step 'idle' computes something else.*lossy=\{'idle'\}"),
    "choose: states missing the control": (lambda: _choose({"a": _lean()}, state={"a": STATE}), ValueError,
                                           r"missing \['control'\]"),
    "choose: lossy a string": (lambda: _choose({"a": _lean()}, lossy="a"), TypeError, r"lossy=\{'dlcp'\}"),
    "choose: lossy not a candidate": (lambda: _choose({"a": _lean()}, lossy={"b"}), ValueError,
                                      r"\['b'\] are not candidates; the candidates are \['a'\]"),
    "choose: compare not callable": (lambda: _choose({"a": _lean()}, compare="params"), TypeError,
                                     r"lambda state: state.params"),
    "choose: warmup 1": (lambda: _choose({"a": _lean()}, warmup=1), ValueError, r"the second is compared"),
    "xla_options: a file name": (lambda: pj.xla_options("schedule.json", NET), TypeError,
                                 r"`schedule` must be a prophet_jax.Schedule.*Schedule.from_json"),
    "xla_options: a preset name": (lambda: pj.xla_options(WFBP, "10gbe"), TypeError,
                                   r"`network` must be a prophet_jax.NetworkModel.*NetworkModel.preset\(name"),
    "xla_options: an unknown target": (lambda: pj.xla_options(WFBP, NET, target="b200"), ValueError,
                                       r"unknown GPU target 'b200'.*'h100'"),
    "tag_plan: an FSDP plan": (lambda: pj.tag_plan(_fsdp()), ValueError, r"family 'fsdp'.*xla_options"),
    "tag_plan: a policy name": (lambda: pj.tag_plan("wfbp"), TypeError, r"expected a prophet_jax.Schedule"),
    "tag_layers: a linen module as model": (_tag_linen_module, TypeError,
                                            r"expected a flax nnx Module \(or model=None for flax linen"),
    "audit: a Lowered": (lambda: pj.audit(jax.jit(lambda x: x * 2).lower(jnp.ones(3)), WFBP), TypeError,
                         r"got a Lowered.*Call .compile\(\)"),
    "audit: enforce_order a string": (lambda: pj.audit(jax.jit(lambda x: x * 2).lower(jnp.ones(3)).compile(), WFBP,
                                                       enforce_order="no"), TypeError,
                                      r"audit\(enforce_order='no'\): `enforce_order` must be True or False"),
    "profile_step: axis_name an int": (lambda: pj.profile_step(_loss, PARAMS, np.ones((16, 16), np.float32),
                                                               axis_name=3), TypeError,
                                       r"`axis_name` must be a non-empty string.*got 3"),
    "profile_step: a tuple axis without a mesh": (
        lambda: pj.profile_step(_loss, PARAMS, np.ones((16, 16), np.float32), axis_name=("a", "b")), ValueError,
        r"without a mesh the profiled step maps the batch over one axis; name it \(axis_name='a'\)"),
    "profile_step: a loss over the pmap axis, no axis_name": (
        lambda: pj.profile_step(lambda p, b: _loss(p, b - jax.lax.pmean(jnp.mean(b, 0), "batch")), PARAMS,
                                np.ones((16, 16), np.float32)), ValueError,
        r"reduces over the axis 'batch'.*Pass axis_name='batch'"),
    "profile_step: an uneven batch": (lambda: pj.profile_step(_loss, PARAMS, np.ones((12, 16), np.float32)),
                                      ValueError, r"divisible by num_devices=8"),
    "measure_network: one device": (lambda: pj.measure_network(1), pj.NetworkError, r"at least 2 devices"),
    "measure_network: budget a string": (lambda: pj.measure_network(8, sizes=(1024, 4096), time_budget_s="10"),
                                         TypeError, r"'auto' or None"),
    "measure_network: one size": (lambda: pj.measure_network(8, sizes=[1024]), ValueError, r"2 distinct sizes"),
}


@pytest.mark.parametrize("name", list(RAISES))
def test_a_bad_input_is_a_clear_error(name):
  call, exc, match = RAISES[name]
  with pytest.raises(exc, match=match):
    call()


def test_a_raising_candidate_is_named():
  def needs_its_own_state(s, b):
    params, opt_state = s
    return _lean()({"params": params}, b)

  with pytest.raises(ValueError) as e:
    _choose({"dear": needs_its_own_state})
  assert any("raised by step 'dear'" in n and "convert_state" in n for n in getattr(e.value, "__notes__", []))


@pytest.mark.gpu
def test_compile_only_targets_take_what_users_write(topo):
  topo.mesh("dp")
  x = jax.ShapeDtypeStruct((16, 4), jnp.float32)
  assert topo.abstract(x, P("dp")).sharding.spec == P("dp")
  with pytest.raises(TypeError, match=r"abstract\(spec='data'\): expected a PartitionSpec.*Write P\('data'\)"):
    topo.abstract(x, "data")
  with pytest.raises(TypeError, match=r"must be a non-empty string"):
    topo.mesh(("a", "b"))


@pytest.mark.gpu
def test_settings_that_do_not_give_the_plan_warn_and_fsdp_gets_its_thresholds(topo, capsys):
  prio = pj.plan(PROFILE, NET, "priority", partition_bytes=128)
  with pytest.warns(UserWarning, match=r"'priority' plan: it sends 1 leaves in parts \('a/w'\)"):
    pj.xla_options(prio, NET, target=topo)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", pj.DeferralWarning)
    dlcp = pj.plan(PROFILE, SLOW, "dlcp", max_defer=0.25, all_layers=True)
  with pytest.warns(UserWarning, match=r"it defers gradient elements \(dlcp\), which no setting does"):
    pj.xla_options(dlcp, SLOW, target=topo)
  options = pj.xla_options(_fsdp(), NET, target=topo)
  assert options["xla_gpu_all_gather_combine_threshold_bytes"] == 64 * 64 * 4
  assert options["xla_gpu_reduce_scatter_combine_threshold_bytes"] == 64 * 64 * 4 // 8
  code = cli.main(["xla-flags", "--model", "resnet50", "--device", "h100", "--workers", "8", "--network", "10gbe",
                   "--policy", "fsdp", "--target", "h100"])
  assert code == 2 and "the profile has no sharded rows" in capsys.readouterr().err
