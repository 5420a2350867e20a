"""audit and _hlo: chunk all-reduces found by named scope in *compiled* plain-user steps, per policy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import prophet_jax as pj
from prophet_jax._compiled._hlo import execution_order, parse_hlo, shape_elements
from prophet_jax._compiled._hlo_collectives import allreduces, collectives, merged_op_names
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
  assert report.ok, report.describe()
  assert report.chunk_allreduces == s.num_allreduces
  assert report.order == tuple(range(s.num_allreduces))
  assert [e.elements for e in report.chunks] == [c.size for c in s.chunks]
  assert sum(e.elements for e in report.foreign) == 1  # the user's pmean, listed apart
  assert "OK" in report.describe()
  with pytest.warns(DeprecationWarning, match="use AuditReport.describe"):  # the old name, README's until 17
    assert report.summary() == report.describe()


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
  assert report.ok, report.describe()
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
  with pytest.raises(TypeError, match=r"audit: `schedule` must be a prophet_jax.Schedule, got str\. Make one"):
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
  assert report.ok, report.describe()
  assert report.loop_allreduces == 5 and report.loops[0].label == "blocks"
  assert [(e.chunk, e.elements) for e in report.chunks] == [(0, 4), (1, 6)]
  assert [(e.elements, e.shared) for e in report.foreign] == [(1, True)]  # the loss rode along
  # after chunk0 the loop body's backward all-reduce still runs; after the loop, no backward op
  assert report.chunks[0].backward_ops_after == 1 and report.loops[0].backward_ops_after == 0
  with pytest.raises(ValueError, match="not an HLO module"):
    parse_hlo("nothing")


# --------------------------------------------------------------------------------------------------
# XLA:GPU's forms: async start/done windows, and all-reduce-contiguous (concatenate, all-reduce, slices)


# the computations and ENTRY head both GPU modules below share
_GPU_CAT = """%cat_body (p0: f32[6], p1: f32[1]) -> f32[7] {
  %p0 = f32[6]{0} parameter(0)
  %p1 = f32[1]{0} parameter(1)
  ROOT %c = f32[7]{0} concatenate(%p0, %p1), dimensions={0}
}
"""
_GPU_TAIL = """%slice_b (q2: f32[7]) -> f32[1] {
  %q2 = f32[7]{0} parameter(0)
  ROOT %s2 = f32[1]{0} slice(%q2), slice={[6:7]}
}

%gemm (a: f32[8,16], b: f32[16,4]) -> f32[8,4] {
  %a = f32[8,16]{1,0} parameter(0)
  %b = f32[16,4]{1,0} parameter(1)
  ROOT %d = f32[8,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f32[8,16], w: f32[16,4]) -> f32[] {
  %x = f32[8,16]{1,0} parameter(0)
  %w = f32[16,4]{1,0} parameter(1)
"""


GPU_HLO = """HloModule g, is_scheduled=true

""" + _GPU_CAT + """
%slice_a (q: f32[7]) -> f32[6] {
  %q = f32[7]{0} parameter(0)
  ROOT %s = f32[6]{0} slice(%q), slice={[0:6]}, metadata={op_name="jit(step)/prophet/SECOND/psum"}
}

""" + _GPU_TAIL + """  %g0 = f32[4]{0} fusion(%x), kind=kLoop, calls=%gemm, metadata={op_name="jit(step)/transpose(jvp(M))/Dense_1/reduce_sum"}
  %ar0 = f32[4]{0} all-reduce-start(%g0), channel_id=1, to_apply=%sum, metadata={op_name="jit(step)/prophet/chunk0/psum"}, backend_config={"collective_backend_config":{"is_sync":false}}
  %mm = f32[8,4]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm, metadata={op_name="jit(step)/transpose(jvp(M))/Dense_0/dot_general"}
  %tie = f32[6]{0} fusion(%mm), kind=kLoop, calls=%gemm, metadata={op_name="jit(step)/prophet/chunk1/add"}
  %ard0 = f32[4]{0} all-reduce-done(%ar0), metadata={op_name="jit(step)/prophet/chunk0/psum"}
  %loss = f32[1]{0} fusion(%x), kind=kLoop, calls=%gemm, metadata={op_name="jit(step)/jvp()/neg"}
  %wc = f32[7]{0} fusion(%tie, %loss), kind=kLoop, calls=%cat_body
  %ar1 = f32[7]{0} all-reduce-start(%wc), channel_id=2, to_apply=%sum, backend_config={"collective_backend_config":{"is_sync":false}}
  %upd = f32[16,4]{1,0} fusion(%w, %ard0), kind=kLoop, calls=%gemm, metadata={op_name="jit(step)/sub"}
  %ard1 = f32[7]{0} all-reduce-done(%ar1)
  %sa = f32[6]{0} fusion(%ard1), kind=kLoop, calls=%slice_a, metadata={op_name="jit(step)/prophet/SECOND/psum"}
  %sb = f32[1]{0} fusion(%ard1), kind=kLoop, calls=%slice_b
  ROOT %r = f32[] add(%sa, %sb)
}
"""


def _two_chunks():
  return pj.Schedule(buckets=(pj.Bucket(chunks=(pj.Chunk(slices=((0, 0, 4),), dtype="float32"),
                                                pj.Chunk(slices=((1, 0, 6),), dtype="float32"))),),
                     rows=(("a", (4,), "float32"), ("b", (6,), "float32")))


def test_audit_reads_through_xla_gpu_contiguous_allreduce_and_reports_windows():
  s = _two_chunks()
  r = pj.audit(GPU_HLO.replace("SECOND", "chunk1"), s)
  assert r.ok, r.describe()
  assert [(e.chunk, e.elements, e.shared) for e in r.chunks] == [(0, 4, False), (1, 6, True)]
  assert [(e.elements, e.shared) for e in r.foreign] == [(1, True)]  # the loss, concatenated along
  c0, c1 = r.chunks
  assert c0.asynchronous and [o.name for o in c0.window] == ["mm", "tie"]
  assert [o.kind for o in c0.window] == ["backward", "rewrite"]
  assert c0.window_flops == 2 * 8 * 4 * 16  # the dot inside the fusion: 2 * |out| * K
  assert c0.window_ops("backward")[0].nbytes == 4 * (8 * 16 + 16 * 4 + 8 * 4)
  assert [o.kind for o in c1.window] == ["other"] and c1.overlapped  # the update of chunk 0's params
  assert r.exposed == () and r.max_in_flight == 1 and r.backward_outside_windows == 0
  assert "2/2 chunk(s) have compute inside" in r.describe()
  assert "Dense_0/dot_general" in r.window_table()


def test_audit_fails_when_two_chunks_share_one_concatenated_allreduce():
  s = _two_chunks()
  # the slice of the concatenation reads back as chunk 0 as well: XLA merged chunks 0 and 1
  r = pj.audit(GPU_HLO.replace("SECOND", "chunk0"), s)
  assert not r.ok
  assert any("share one all-reduce" in p or "reduces 6 elements, planned 4" in p for p in r.problems), \
      r.describe()


def test_audit_report_json_round_trip_on_the_cpu():
  grads, profile = _grads_and_profile()
  s = pj.plan(profile, pj.NetworkModel.preset("10gbe", workers=NDEV), "wfbp")
  compiled = jax.pmap(_step(s), axis_name=AX).lower(grads, jnp.ones((NDEV, 3))).compile()
  report = pj.audit(compiled, s)
  assert pj.AuditReport.from_json(report.to_json()) == report
  assert pj.AuditReport.from_json(report.to_dict()) == report
  assert not report.asynchronous and report.exposed == tuple(range(s.num_allreduces))  # CPU: synchronous
  with pytest.raises(ValueError, match="malformed JSON"):
    pj.AuditReport.from_json("{")
  with pytest.raises(ValueError, match="missing field"):
    pj.AuditReport.from_json({"planned": 1})


# jaxlib 0.12's XLA:GPU (as `prophet-jax audit` compiled it, trimmed): chunk 0 in an asynchronous collective
# fusion (fusion-start/done whose called computation's ROOT is the all-reduce), chunk 1 concatenated with
# the loss into one all-reduce-start whose shape is (operands, result) and whose op_name merges both
GPU_HLO_012 = """HloModule g, is_scheduled=true

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(%a, %b)
}

%fused_psum.0.clone (param_0.1: f32[4]) -> f32[4] {
  %param_0.1 = f32[4]{0} parameter(0)
  ROOT %psum.2 = f32[4]{0} all-reduce(%param_0.1), channel_id=1, to_apply=%sum, metadata={op_name="jit(step)/shard_map/prophet/chunk0/psum"}, backend_config={"collective_backend_config":{"is_sync":false}}
}

""" + _GPU_CAT + """
%slice_a (q: f32[7]) -> f32[6] {
  %q = f32[7]{0} parameter(0)
  ROOT %s = f32[6]{0} slice(%q), slice={[0:6]}
}

""" + _GPU_TAIL + """  %g0 = f32[4]{0} fusion(%x), kind=kLoop, calls=%gemm, metadata={op_name="jit(step)/shard_map/transpose(jvp(M))/Dense_1/reduce_sum"}
  %fusion-start = ((f32[4]{0}), f32[4]{0}) fusion-start(%g0), kind=kCustom, calls=%fused_psum.0.clone, metadata={op_name="jit(step)/shard_map/prophet/chunk0/psum"}, backend_config={"fusion_backend_config":{"kind":"__triton_collective"}}
  %mm = f32[8,4]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm, metadata={op_name="jit(step)/shard_map/transpose(jvp(M))/Dense_0/dot_general"}
  %fusion-done = f32[4]{0} fusion-done(%fusion-start), metadata={op_name="jit(step)/shard_map/prophet/chunk0/psum"}
  %tie = f32[6]{0} fusion(%mm, %fusion-done), kind=kLoop, calls=%gemm, metadata={op_name="jit(step)/shard_map/prophet/chunk1/add"}
  %loss = f32[1]{0} fusion(%x), kind=kLoop, calls=%gemm, metadata={op_name="jit(step)/shard_map/jvp()/neg"}
  %wc = f32[7]{0} fusion(%tie, %loss), kind=kLoop, calls=%cat_body
  %all-reduce-start = ((f32[7]{0}), f32[7]{0}) all-reduce-start(%wc), channel_id=2, to_apply=%sum, metadata={op_name="jit(step)/shard_map/(prophet/chunk1/psum:psum)"}, backend_config={"collective_backend_config":{"is_sync":false}}
  %upd = f32[16,4]{1,0} fusion(%w, %fusion-done), kind=kLoop, calls=%gemm, metadata={op_name="jit(step)/shard_map/sub"}
  %all-reduce-done = f32[7]{0} all-reduce-done(%all-reduce-start), metadata={op_name="jit(step)/shard_map/(prophet/chunk1/psum:psum)"}
  %sa = f32[6]{0} fusion(%all-reduce-done), kind=kLoop, calls=%slice_a, metadata={op_name="jit(step)/shard_map/prophet/chunk1/psum"}
  %sb = f32[1]{0} fusion(%all-reduce-done), kind=kLoop, calls=%slice_b
  ROOT %r = f32[] add(%sa, %sb)
}
"""


def test_merged_op_names():
  assert merged_op_names("jit(f)/shard_map/(prophet/chunk5/psum:psum)") == (
      "jit(f)/shard_map/prophet/chunk5/psum", "jit(f)/shard_map/psum")
  assert merged_op_names("jit(f)/(transpose(jvp(M))/prophet/chunk2/psum:a:b)") == (
      "jit(f)/transpose(jvp(M))/prophet/chunk2/psum", "jit(f)/a", "jit(f)/b")
  for one in ("jit(f)/transpose(jvp(M))", "jit(f)/prophet/chunk1/psum", "", "(a:b"):
    assert merged_op_names(one) == (one,)


def test_audit_reads_jaxlib_0_12_collective_fusions_and_merged_names_and_says_the_form():
  s = _two_chunks()
  r = pj.audit(GPU_HLO_012, s)
  assert r.ok, r.describe()
  assert [(e.chunk, e.elements, e.shared, e.form) for e in r.chunks] == [
      (0, 4, False, "fusion-start"), (1, 6, True, "all-reduce-start")]
  assert [(e.elements, e.shared, e.form) for e in r.foreign] == [(1, True, "all-reduce-start")]
  assert r.forms == {"fusion-start": 1, "all-reduce-start": 2}
  assert "read: 1 fusion-start/done (async collective fusion), 2 all-reduce-start/done (async)" in r.describe()
  c0, c1 = r.chunks
  assert c0.asynchronous and [(o.name, o.kind) for o in c0.window] == [("mm", "backward")]
  assert c1.asynchronous and [o.name for o in c1.window] == ["upd"]
  assert r.max_in_flight == 1 and r.exposed == () and not r.warnings
  # fusion-start/done inside another window count as collectives, not compute
  ops = allreduces(parse_hlo(GPU_HLO_012))
  assert [(a.form, a.elements, a.operands) for a in ops] == [("fusion-start", 4, ("g0",)),
                                                            ("all-reduce-start", 7, ("wc",))]
  # chunk 0 exposed as a collective kernel: the audit says why and what to set
  mm = next(line for line in GPU_HLO_012.splitlines() if line.startswith("  %mm = "))
  exposed = GPU_HLO_012.replace(mm + "\n", "").replace("(%mm, %fusion-done)", "(%x, %fusion-done)")
  r2 = pj.audit(exposed, s)
  assert r2.ok and r2.exposed == (0,), r2.describe()
  assert any("collective kernels" in w and "use_collective_kernels=-ALL_REDUCE" in w for w in r2.warnings)
  # a merged name of two chunks is still two chunks in one all-reduce
  both = (GPU_HLO_012.replace("(prophet/chunk1/psum:psum)", "(prophet/chunk1/psum:prophet/chunk0/psum)")
          .replace("calls=%slice_b\n", 'calls=%slice_b, metadata={op_name="x/prophet/chunk0/psum"}\n'))
  r3 = pj.audit(both, s)
  assert not r3.ok and any("chunk0" in p for p in r3.problems), r3.describe()
