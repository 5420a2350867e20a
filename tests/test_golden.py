"""The golden file's check can fail (tests/_golden.py): one tiny compiled program, and its summary
compared with golden summaries that double, resize or swap its collectives."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import _golden


@pytest.fixture(scope="module")
def compiled():
  mesh = jax.make_mesh((8,), ("data",))

  def f(a, b):
    return (jax.lax.psum(a, "data"), jax.lax.psum_scatter(b, "data", tiled=True),
            jax.lax.all_gather(b, "data"))

  step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=(P(), P("data"), P("data"))))
  a, b = (jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, P("data")))
          for s in ((24, 4), (64, 2)))
  return step.lower(a, b).compile()


def _parts(summary):
  return [(t.split()[0], t.split()[1]) for t in summary.split("; ")]


def test_a_compiled_programs_collectives_and_the_hook(compiled, request):
  summary = _golden.summarize(compiled.as_text())
  # per device: a psum of 3x4, a reduce-scatter of 8x2 to 1x2, an all-gather of 8x2 to 8x8x2
  assert sorted(_parts(summary)) == [("all-gather", "f32:128"), ("all-reduce", "f32:12"),
                                     ("reduce-scatter", "f32:2")]
  state = request.config.stash[_golden._KEY]
  if state.mode != "off":  # the hook saw the compile and gave it to this test
    assert summary in state.compiled[request.node.nodeid], state.hook_error


def test_doubled_resized_or_swapped_collectives_are_mismatches(compiled):
  summary = _golden.summarize(compiled.as_text())
  t = summary.split("; ")
  doubled = "; ".join([t[0] + " x2", *t[1:]])
  resized = summary.replace("f32:12 ", "f32:13 ")
  swapped = "; ".join([t[1], t[0], *t[2:]])
  assert len({summary, doubled, resized, swapped}) == 4
  assert _golden.mismatch(summary, [summary]) is None
  assert _golden.mismatch(summary, [doubled, summary]) is None
  for wrong in (doubled, resized, swapped):
    why = _golden.mismatch(summary, [wrong])
    assert why is not None and f"nearest:  {wrong}" in why and "\n-" in why and "\n+" in why


def test_a_program_missing_from_its_tests_entries_fails_the_test(compiled):
  summary = _golden.summarize(compiled.as_text())
  state = _golden.Golden("off")
  state.mode, state.path = "check", _golden.GOLDEN_DIR / "jax-test.json"
  state.golden = {"t.py::a": [summary.replace("f32:12 ", "f32:13 ")], "t.py::b": [summary]}
  state.unchecked = [("t.py::a", "jit_f", summary)]
  with pytest.raises(pytest.fail.Exception, match="f32:13"):
    state.check()
  state.unchecked = [("t.py::b", "jit_f", summary), ("t.py::new", "jit_f", summary)]
  state.check()  # present, or a test without entries (reported, not failed)
  assert state.new_tests == {"t.py::new"}
  state.measured, state.unchecked = True, [("t.py::a", "jit_f", summary)]
  state.check()  # a test marked golden_measured: reported, not failed
  assert state.measured_misses == {"t.py::a"}


# the forms of jax 0.12's XLA:GPU (a collective fusion), an async pair, a loop, a conditional
HLO = """HloModule jit_step, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_psum (p: f32[650]) -> f32[650] {
  %p = f32[650]{0} parameter(0)
  ROOT %ar = f32[650]{0} all-reduce(%p), channel_id=1, replica_groups=mesh['data'=8] {'data'}, to_apply=%add
}

%body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%t), index=1
  %ag = f32[64]{0} all-gather(%x), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %x)
}

%cond (t: (s32[], f32[8])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

%then (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %cp = f32[8]{0} collective-permute(%x), channel_id=3, source_target_pairs={{0,1},{1,0}}
}

%else (x: f32[8]) -> f32[8] {
  ROOT %x = f32[8]{0} parameter(0)
}

ENTRY %main (x: f32[650], y: f32[8,4], t: (s32[], f32[8]), q: pred[]) -> f32[650] {
  %x = f32[650]{0} parameter(0)
  %fusion-start = ((f32[650]{0}), f32[650]{0}, u32[]) fusion-start(%x), kind=kCustom, calls=%fused_psum
  %fusion-done = f32[650]{0} fusion-done(%fusion-start)
  %rs-start = ((f32[8,4]{1,0}), f32[1,4]{1,0}) reduce-scatter-start(%y), channel_id=4, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, to_apply=%add
  %rs-done = f32[1,4]{1,0} reduce-scatter-done(%rs-start)
  %w = (s32[], f32[8]{0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %k = f32[8]{0} conditional(%q, %z, %z), true_computation=%then, false_computation=%else
  %ar2 = (f32[2]{0}, bf16[3]{0}) all-reduce(%a, %b), channel_id=5, replica_groups={}, to_apply=%add
  ROOT %out = f32[650]{0} copy(%fusion-done)
}
"""


def test_the_forms_xla_writes_collectives_in():
  assert _golden.summarize(HLO) == (
      "all-reduce f32:650 mesh['data'=8]{'data'}; reduce-scatter f32:4 {{0-3},{4-7}}; "
      "while*3(; all-gather f32:64 {{0-7}}; ); cond(; collective-permute f32:8 {{0,1},{1,0}}; |; ); "
      "all-reduce f32:2+bf16:3 {}")
  assert _golden.summarize(HLO.split("%fused_psum")[0] + "ENTRY %m () -> f32[] {\n}\n") is None
