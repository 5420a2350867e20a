"""audit and _hlo: chunk all-reduces found by named scope in *compiled* plain-user steps, per policy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import prophet_jax as pj
from prophet_jax._hlo import collectives, execution_order, parse_hlo, shape_elements
from prophet_jax.models import get_model

AX = "data"
NDEV = 8
POLICIES = ("wfbp", "bucket", "xla", "mgwfbp", "priority", "prophet", "auto")
OPTIONS = {"priority": {"partition_bytes": 4096}}


def _grads_and_profile():
  params = get_model("mlp").abstract_params()  # 24 leaves: priority cuts ~20 chunks
  profile = pj.GradientProfile.from_params(params, forward_s=1e-3, backward_s=2e-3)
  grads = jax.tree.map(lambda a: jnp.ones((NDEV, *a.shape), a.dtype), params)
  return grads, profile


def _step(s):
  def step(g, x):  # a plain user step: the scheduled all-reduce, plus the user's own pmean
    return pj.allreduce(g, s, AX), jax.lax.pmean(jnp.sum(x), AX)
  return step


@pytest.mark.parametrize("policy", POLICIES)
def test_audit_pmap_every_policy(policy):
  grads, profile = _grads_and_profile()
  s = pj.plan(profile, pj.NetworkModel.preset("10gbe", workers=NDEV), policy, **OPTIONS.get(policy, {}))
  compiled = jax.pmap(_step(s), axis_name=AX).lower(grads, jnp.ones((NDEV, 3))).compile()
  report = pj.audit(compiled, s)
  assert report.ok, report.summary()
  assert report.chunk_allreduces == s.num_allreduces
  assert report.order == tuple(range(s.num_allreduces))
  assert [e.elements for e in report.chunks] == [c.size for c in s.chunks]
  assert sum(e.elements for e in report.foreign) == 1  # the user's pmean, listed apart
  assert "OK" in report.summary()


@pytest.mark.parametrize("policy", ["wfbp", "priority"])
def test_audit_shard_map(policy):
  grads, profile = _grads_and_profile()
  s = pj.plan(profile, pj.NetworkModel.preset("10gbe", workers=NDEV), policy, **OPTIONS.get(policy, {}))
  mesh = jax.make_mesh((NDEV,), (AX,))
  g1 = jax.tree.map(lambda a: a[0], grads)

  def step(g, x):
    g = jax.lax.pcast(g, AX, to="varying")
    return _step(s)(g, x)

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(AX)), out_specs=(P(), P())))
  args = (jax.device_put(g1, NamedSharding(mesh, P())),
          jax.device_put(jnp.ones(NDEV), NamedSharding(mesh, P(AX))))
  report = pj.audit(f.lower(*args).compile(), s)
  assert report.ok, report.summary()
  assert report.order == tuple(range(s.num_allreduces)) and s.num_allreduces > 1


def test_audit_reports_merged_allreduces_of_a_plain_pmean():
  grads, profile = _grads_and_profile()
  s = pj.plan(profile, pj.NetworkModel.preset("10gbe", workers=NDEV), "wfbp")
  compiled = jax.pmap(lambda g: jax.lax.pmean(g, AX), axis_name=AX).lower(grads).compile()
  report = pj.audit(compiled, s)
  assert not report.ok and report.chunk_allreduces == 0
  assert len(report.foreign) >= 1
  assert any("no all-reduce of their own" in p for p in report.problems)


def test_audit_rejects_lowered_and_non_schedule():
  grads, profile = _grads_and_profile()
  s = pj.plan(profile, pj.NetworkModel.preset("10gbe", workers=NDEV), "wfbp")
  lowered = jax.pmap(_step(s), axis_name=AX).lower(grads, jnp.ones((NDEV, 3)))
  with pytest.raises(TypeError, match=r"\*compiled\* step"):
    pj.audit(lowered, s)
  with pytest.raises(TypeError, match="must be a prophet_jax.Schedule"):
    pj.audit("HloModule m", "s")


# --------------------------------------------------------------------------------------------------
# _hlo on hand-written text: loops, trip counts, combined operands


HLO = """HloModule m, is_scheduled=true, entry_computation_layout={()->f32[]}

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  %g = f32[4]{0} get-tuple-element(%p), index=1
  %ar = f32[4]{0} all-reduce(%g), channel_id=1, to_apply=%sum, metadata={op_name="x/transpose(jvp())/while/body/prophet/loop/blocks/psum"}
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %ar)
}

%cond (p: (s32[], f32[4])) -> pred[] {
  ROOT %lt = pred[] compare(%a, %b), direction=LT
}

ENTRY %main (x: f32[4]) -> f32[] {
  %x = f32[4]{0} parameter(0)
  %m = f32[4]{0} multiply(%x, %x), metadata={op_name="x/transpose(jvp())/mul"}
  %ar0 = f32[4]{0} all-reduce(%m), channel_id=2, to_apply=%sum, metadata={op_name="x/prophet/chunk0/psum"}
  %w = (s32[], f32[4]{0}) while(%tt), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %c = (f32[6]{0}, f32[]) all-reduce(%ar0b, %loss), channel_id=3, to_apply=%sum, metadata={op_name="x/(prophet/chunk1/psum:psum)"}
  %ar0b = f32[6]{0} add(%m, %m), metadata={op_name="x/prophet/chunk1/add"}
  ROOT %r = f32[] add(%a, %b)
}
"""


def test_hlo_parser_loops_trip_counts_and_combined_operands():
  m = parse_hlo(HLO)
  assert m.entry == "main" and m.scheduled
  ops = collectives(m)
  assert [o.instruction.name for o in ops] == ["ar0", "ar", "c"]
  assert ops[1].trips == 5 and ops[1].loops == ("w",) and ops[0].trips == 1
  assert ops[2].instruction.part_elements == (6, 1) and ops[2].instruction.operands == ("ar0b", "loss")
  assert shape_elements("(f32[2,3]{1,0}, bf16[], token[])") == 7
  # m, ar0, the loop condition's compare, the body's ar, c, ar0b, r (tuples, parameters, whiles left out)
  assert [o.instruction.name for o in execution_order(m)] == ["m", "ar0", "lt", "ar", "c", "ar0b", "r"]
  s = pj.Schedule(buckets=(pj.Bucket(chunks=(pj.Chunk(slices=((0, 0, 4),), dtype="float32"),
                                             pj.Chunk(slices=((1, 0, 6),), dtype="float32"))),),
                  rows=(("a", (4,), "float32"), ("b", (6,), "float32")))
  report = pj.audit(HLO, s)
  assert report.ok, report.summary()
  assert report.loop_allreduces == 5 and report.loops[0].label == "blocks"
  assert [(e.chunk, e.elements) for e in report.chunks] == [(0, 4), (1, 6)]
  assert [(e.elements, e.shared) for e in report.foreign] == [(1, True)]  # the loss rode along
  # after chunk0 the loop body's backward all-reduce still runs; after the loop, no backward op
  assert report.chunks[0].backward_ops_after == 1 and report.loops[0].backward_ops_after == 0
  with pytest.raises(ValueError, match="not an HLO module"):
    parse_hlo("nothing")
