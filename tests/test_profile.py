"""profile_step: a measured profile of a real step, its fallbacks, and clear errors on bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _trace_bug import merge_runs
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from prophet_jax import GradientProfile, ProfileError, profile_step
from prophet_jax._measure import _profile, _profile_methods, _step_hlo, _xplane
from prophet_jax._values._tree import path_str

N = 8  # conftest gives 8 CPU devices


def _tiny():
  """A 3-layer pure-jax model (dict params, one integer leaf that is not a row)."""
  k = jax.random.split(jax.random.key(0), 4)
  params = {"l0": {"w": jax.random.normal(k[0], (8, 32)) * 0.3, "b": jnp.zeros((32,))},
            "l1": {"w": jax.random.normal(k[1], (32, 32)) * 0.2},
            "l2": {"w": jax.random.normal(k[2], (32, 4)) * 0.2},
            "count": jnp.zeros((), jnp.int32)}

  def loss(p, b):
    h = jnp.tanh(b["x"] @ p["l0"]["w"] + p["l0"]["b"])
    h = jnp.tanh(h @ p["l1"]["w"])
    return jnp.mean((h @ p["l2"]["w"] - b["y"]) ** 2)

  batch = {"x": jax.random.normal(k[3], (8 * N, 8)), "y": jnp.ones((8 * N, 4))}
  return loss, params, batch


def _empty_trace(trace, modules):
  """A trace in which the profiler recorded nothing of the step."""
  return _xplane.Trace(events={m: [] for m in modules}, launches={}, linked={}, platform="cpu", files=[])


@pytest.fixture(scope="module")
def mlp_profile():
  from prophet_jax.models import get_model

  m = get_model("mlp")
  params = _fsdp_placed(m.init(jax.random.key(0)))  # kernels sharded over 'data' (FSDP), biases replicated
  batch = m.make_batch(jax.random.key(1), m.default_batch_size)
  import optax

  prof = profile_step(m.loss_fn, params, batch, num_devices=N, steps=2, warmup=1,
                      tx=optax.sgd(0.1, momentum=0.9), model="mlp")
  return m, params, prof


def _fsdp_placed(params, split=lambda path: path.endswith("kernel")):
  """params on an 8-device ('data',) mesh: leaves whose path `split` picks with P('data', None),
  the others P()."""
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:N]), ("data",))
  return jax.tree_util.tree_map_with_path(
      lambda kp, x: jax.device_put(x, NamedSharding(mesh, P("data", None) if split(path_str(kp)) else P())),
      params)


def test_measured_profile_has_every_row_exact_sizes_and_ready_within_step(mlp_profile):
  m, params, prof = mlp_profile
  assert prof.method == "measured"
  ref = GradientProfile.from_params(params)
  assert {r.path for r in prof.rows} == {r.path for r in ref.rows}
  exact = {r.path: (r.shape, r.dtype, r.nbytes) for r in ref.rows}
  for r in prof.rows:
    assert (r.shape, r.dtype, r.nbytes) == exact[r.path]
    assert 0.0 <= r.ready_s <= prof.backward_s
  assert prof.backward_s > 0 and prof.forward_s > 0 and prof.update_s > 0
  # rows in forward (priority) order, not flatten order (flatten puts Dense_10 before Dense_2)
  assert [r.path for r in prof.rows] == list(m.forward_paths(params))
  # backward runs back to front: the classifier's gradient is ready long before the input layer's
  ready = {r.path: r.ready_s for r in prof.rows}
  assert ready["params/Dense_11/kernel"] < ready["params/Dense_0/kernel"]
  assert ready["params/Dense_0/kernel"] > 0.5 * prof.backward_s
  # per-layer forward times sum to forward_s, and more than one layer got some
  assert sum(r.fwd_s for r in prof.rows) == pytest.approx(prof.forward_s)
  assert sum(1 for r in prof.rows if r.fwd_s > 0) >= 6
  # the placement is read from the arrays (kernels sharded on dimension 0 over 'data', biases replicated)
  assert prof.mesh == (("data", N),) and prof.shard_axes == ("data",)
  assert {r.path: r.shard_dim for r in prof.rows} == {r.path: 0 if r.path.endswith("kernel") else None
                                                      for r in ref.rows}
  assert prof.fingerprint() != ref.fingerprint()
  # JSON round trip (placement included) and the CLI summary
  assert GradientProfile.from_json(prof.to_json()) == prof
  text = prof.describe()
  assert "measured" in text and "24 gradients" in text


def test_no_profiler_events_falls_back_to_timing(monkeypatch):
  loss, params, batch = _tiny()
  monkeypatch.setattr(_xplane, "read_trace", _empty_trace)
  prof = profile_step(loss, params, batch, num_devices=N, steps=3)
  assert prof.method == "timed"
  assert "profiler unusable" in prof.notes and "no events" in prof.notes
  assert [r.path for r in prof.rows] == ["l0/w", "l0/b", "l1/w", "l2/w"]  # 'count' (int) is no row
  assert all(0 <= r.ready_s <= prof.backward_s for r in prof.rows)
  with pytest.raises(ProfileError, match="method='measured'.*no events"):
    profile_step(loss, params, batch, num_devices=N, method="measured")


def test_estimated_when_asked_and_when_timing_fails(monkeypatch):
  loss, params, batch = _tiny()
  prof = profile_step(loss, params, batch, num_devices=N, method="estimated")
  assert prof.method == "estimated" and "FLOPs" in prof.notes
  assert prof.forward_s > 0 and prof.backward_s > 0
  monkeypatch.setattr(_xplane, "read_trace", _empty_trace)

  def broken(*a, **k):
    raise RuntimeError("no clock")

  monkeypatch.setattr(_profile, "timed", broken)
  prof = profile_step(loss, params, batch, num_devices=N, steps=1)
  assert prof.method == "estimated" and "timing failed" in prof.notes


def test_placement_is_recorded_not_measured():
  """Params placed on the mesh: sharded leaves give rows with shard_dim and the mesh's shape, the
  programs measured are the same (the same FLOPs as the host params'); all-replicated params give the
  profile without placement (the fingerprint of host params); a leaf split on two dimensions is
  refused before anything compiles."""
  loss, params, batch = _tiny()
  host = profile_step(loss, params, batch, num_devices=N, method="estimated")
  placed = _fsdp_placed(params, lambda p: p in ("l0/w", "l1/w"))
  mesh = next(iter(placed["l0"]["w"].sharding.mesh.shape.items()))
  prof = profile_step(loss, placed, batch, num_devices=N, method="estimated")
  assert prof.mesh == (mesh,) == (("data", N),) and prof.shard_axes == ("data",)
  assert {r.path: r.shard_dim for r in prof.rows} == {"l0/w": 0, "l1/w": 0, "l0/b": None, "l2/w": None}
  assert prof.fingerprint() != host.fingerprint()
  assert prof.notes.split(" FLOPs")[0] == host.notes.split(" FLOPs")[0]   # what is measured is unchanged
  shardings = jax.tree_util.tree_map(lambda x: x.sharding, placed)
  assert prof.fingerprint() == host.with_placement(params, shardings).fingerprint()
  replicated = profile_step(loss, _fsdp_placed(params, lambda p: False), batch, num_devices=N,
                            method="estimated")
  assert replicated.mesh == () and all(r.shard_dim is None for r in replicated.rows)
  assert replicated.fingerprint() == host.fingerprint()
  grid = jax.sharding.Mesh(np.asarray(jax.devices()[:N]).reshape(2, 4), ("a", "b"))
  twice = {**params, "l1": {"w": jax.device_put(params["l1"]["w"], NamedSharding(grid, P("a", "b")))}}
  with pytest.raises(ProfileError, match="profile_step.*'l1/w'.*split on dimensions"):
    profile_step(loss, twice, batch, num_devices=N, method="estimated")


def test_measured_tiny_model_maps_every_leaf():
  loss, params, batch = _tiny()
  prof = profile_step(loss, params, batch, num_devices=4, steps=2, method="measured")
  assert prof.method == "measured" and "4 devices" in prof.notes
  ready = {r.path: r.ready_s for r in prof.rows}
  assert ready["l2/w"] <= ready["l0/w"]
  assert max(ready.values()) > 0


def test_bad_input_is_named():
  loss, params, batch = _tiny()
  bad = dict(batch, x=batch["x"][:7])
  with pytest.raises(ValueError, match=r"batch leaf 'batch/x' has shape \(7, 8\).*divisible by num_devices=8"):
    profile_step(loss, params, bad, num_devices=N)
  wrong_features = dict(batch, x=jnp.ones((8 * N, 9)))
  with pytest.raises(ValueError, match="failed on a per-device batch of shapes.*x: \\(8, 9\\)"):
    profile_step(loss, params, wrong_features, num_devices=N)
  with pytest.raises(TypeError, match="real floating scalar"):
    profile_step(lambda p, b: jnp.argmax(b["x"] @ p["l0"]["w"]), params, batch, num_devices=N)
  with pytest.raises(TypeError, match="not differentiable in params"):
    profile_step(lambda p, b: jax.pure_callback(lambda x: np.float32(x), jax.ShapeDtypeStruct((), jnp.float32),
                                                jnp.sum(p["l1"]["w"])), params, batch, num_devices=N)
  with pytest.raises(ValueError, match="num_devices=99"):
    profile_step(loss, params, batch, num_devices=99)
  with pytest.raises(ValueError, match="method='fast'"):
    profile_step(loss, params, batch, method="fast")
  with pytest.raises(ProfileError, match="no floating-point leaves"):
    profile_step(loss, {"n": jnp.zeros((3,), jnp.int32)}, batch, num_devices=N)


def test_hlo_parsing_follows_root_tuple_and_op_names():
  text = """HloModule jit_m, is_scheduled=true

%fused (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %m = f32[4]{0} multiply(%p0, %p0), metadata={op_name="jit(f)/transpose(jvp(Net))/Dense_1/mul"}
}

ENTRY %main (a: f32[4]) -> (f32[4], f32[4]) {
  %a = f32[4]{0} parameter(0), metadata={op_name="p"}
  %f = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused, metadata={op_name="jit(f)/transpose(jvp(Net))/Dense_1/mul"}
  %c = f32[4]{0} copy(%f)
  ROOT %t = (f32[4]{0}, f32[4]{0}) tuple(%c, %a)
}
"""
  hlo = _step_hlo.step_hlo(text)
  assert hlo.module == "jit_m" and hlo.entry == "main" and hlo.root_operands == ["c", "a"]
  assert hlo.instrs["f"].calls == ["fused"] and hlo.instrs["f"].operands == ["a"]
  assert hlo.instrs["c"].operands == ["f"]
  assert _step_hlo.match_layer(hlo.instrs["f"].op_name, ["params/Dense_0", "params/Dense_1"]) == \
      "params/Dense_1"
  assert _step_hlo.match_layer("jit(f)/jvp(Net)/Block_1/Dense_0/dot",
                               ["p/Block_0/Dense_0", "p/Block_1/Dense_0"]) == "p/Block_1/Dense_0"
  ev = [{"op": "f", "start_ns": 100.0, "end_ns": 400.0, "run": 1, "device": 0}]
  fwd_s, bwd_s, ready, fwd = _xplane.analyse_execution(ev, hlo, [0, 1], 2, ["params/Dense_1"])
  assert fwd_s == 0 and bwd_s == pytest.approx(300e-9)
  assert ready == [pytest.approx(300e-9), 0.0]  # the copy of f is ready when f ends; a parameter at 0


def test_implausible_trace_falls_back_with_a_note_or_raises_saying_what_it_held(monkeypatch):
  """The GPU bug on the CPU: every traced step in one execution. 'auto' falls back to timing and says
  why; 'measured' raises with what the trace held."""
  loss, params, batch = _tiny()
  merge_runs(monkeypatch)   # the old bug: every step in one run
  prof = profile_step(loss, params, batch, num_devices=2, steps=3)
  assert prof.method == "timed"
  assert "profiler unusable (implausible trace: 2 execution(s) found where 6 were traced (3 steps x 2 " \
         "devices)" in prof.notes
  with pytest.raises(ProfileError, match=r"method='measured'\): implausible trace: 2 execution\(s\) found "
                                         r"where 6 were traced.*the trace held \d+ op events of "
                                         r"'jit_prophet_profile_step' in 2 execution\(s\) on 2 device\(s\)"):
    profile_step(loss, params, batch, num_devices=2, steps=3, method="measured")


def test_kept_cpu_trace_reads_back_with_profile_from_trace(tmp_path):
  """profile_step(trace_dir=d) keeps the trace and the program's HLO; profile_from_trace reads them
  (XLA:CPU's events carry run_id): the same rows, the same executions, the trace's own clock."""
  from prophet_jax import profile_from_trace

  loss, params, batch = _tiny()
  prof = profile_step(loss, params, batch, num_devices=2, steps=2, method="measured", trace_dir=str(tmp_path))
  with open(tmp_path / _profile_methods.HLO_FILE) as f:
    text = f.read()
  back = profile_from_trace(tmp_path, text, params)
  assert back.method == "measured" and "4 executions (executions by run_id) on 2 device(s)" in back.notes
  assert [r.path for r in back.rows] == [r.path for r in prof.rows] == ["l0/w", "l0/b", "l1/w", "l2/w"]
  ready = {r.path: r.ready_s for r in back.rows}
  assert ready["l2/w"] <= ready["l0/w"] and back.backward_s > 0 and back.update_s == 0


def test_timing_compiles_a_bounded_number_of_layer_programs(monkeypatch):
  """One gradient program per layer is one compile per layer (BERT-base: 100): at most TIMED_LAYERS,
  evenly spaced, the layers between interpolated by parameter bytes."""
  loss, params, batch = _tiny()
  monkeypatch.setattr(_profile_methods, "TIMED_LAYERS", 2)
  made = []
  real = _profile_methods.grad_program

  def counting(s, wrt=None, name=_profile_methods.STEP_NAME):
    made.append(wrt)
    return real(s, wrt, name)

  monkeypatch.setattr(_profile_methods, "grad_program", counting)
  prof = profile_step(loss, params, batch, num_devices=2, steps=3, method="timed")
  assert prof.method == "timed" and "2 of the 3 layers" in prof.notes
  assert [w for w in made if w is not None] == [[0, 1], [3]]  # l0 (w, b) and l2; l1 interpolated
  ready = {r.path: r.ready_s for r in prof.rows}
  lo, hi = sorted((ready["l0/w"], ready["l2/w"]))
  assert lo <= ready["l1/w"] <= hi and ready["l0/b"] == ready["l0/w"]
  assert _profile_methods._sample(100, 12) == [0, 9, 18, 27, 36, 45, 54, 63, 72, 81, 90, 99]


def test_a_scanned_stack_of_sharded_params_is_profiled_per_layer():
  """FSDP params whose loss scans a stack of them (jax.lax.scan here; linen's nn.scan too, read from the jaxpr
  alone): profile_step finds the stack (`scanned_stacks`) and plans it per layer, rows '<prefix>/<k>/<rest>' in
  the forward order, `stacks` set; the same params all replicated keep their whole rows (an all-reduce plan
  needs no per-layer view)."""
  import flax.linen as nn
  L, D = 3, 16
  k = jax.random.split(jax.random.key(0), 2)
  params = {"head": {"w": jax.random.normal(k[0], (D, D)) * 0.2},
            "stack": {"b": jnp.zeros((L, D)), "w": jax.random.normal(k[1], (L, D, D)) * 0.2}}

  def loss(p, b):
    x, _ = jax.lax.scan(lambda x, lp: (jnp.tanh(x @ lp["w"] + lp["b"]), None), b["x"], p["stack"])
    return jnp.mean((x @ p["head"]["w"] - b["y"]) ** 2)

  batch = {"x": jnp.ones((2 * N, D)), "y": jnp.ones((2 * N, D))}
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:N]), ("data",))
  spec = {"head": {"w": P("data", None)}, "stack": {"b": P(), "w": P(None, "data", None)}}
  placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, spec)
  prof = profile_step(loss, placed, batch, num_devices=N, method="estimated")
  assert prof.stacks == ("stack",) and [r.path for r in prof.rows] == [
      f"stack/{i}/{n}" for i in range(L) for n in ("w", "b")] + ["head/w"]
  assert {r.path: r.shard_dim for r in prof.rows if r.path.endswith("w")} == {
      **{f"stack/{i}/w": 0 for i in range(L)}, "head/w": 0}
  assert profile_step(loss, params, batch, num_devices=N, method="estimated").stacks == ()

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return jnp.tanh(nn.Dense(D)(x)), None

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=L)()(x, None)
      return nn.Dense(D)(x)

  model = Model()
  lp = model.init(jax.random.key(0), jnp.ones((1, D)))
  got = _profile.scanned_stacks(lambda p, b: jnp.mean(model.apply(p, b["x"]) ** 2), lp, batch)
  assert got == ("params/ScanBlock_0",)
