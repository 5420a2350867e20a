"""Profiles from real GPU profiler traces (`profile_from_trace`, `_xplane`), read on the CPU.

The fixtures are the traces `profile_step` kept on one NVIDIA H200 (jax 0.11.2; tests/fixtures/README.md):
3 traced steps of the grad program `jit_prophet_profile_step`, each followed by the optimizer's update
program. GPU kernel events carry no `run_id`: grouping by it merged the 3 steps into one execution, and
the profile said ResNet-50's backward took 0.52 ms of a 19.2 ms step with 156 of 161 leaves ready at one
instant. These tests pin the fix and the checks that would have refused that profile.
"""

import functools
import gzip
import os
import re

import jax
import numpy as np
import pytest

from _trace_bug import merge_runs

from prophet_jax import GradientProfile, NetworkModel, ProfileError, plan, profile_from_trace
from prophet_jax._measure import _step_hlo, _xplane
from prophet_jax._values._tree import layer_of

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
STEP = "jit_prophet_profile_step"
UPDATE = "jit_prophet_profile_update"


@functools.lru_cache(maxsize=None)
def _hlo(name):
  with gzip.open(os.path.join(FIXTURES, f"h200-{name}.hlo.txt.gz"), "rt") as f:
    return f.read()


def _trace(name):
  return os.path.join(FIXTURES, f"h200-{name}.xplane.pb.gz")


@functools.lru_cache(maxsize=None)  # tracing ResNet-50's forward for its order takes seconds: once
def _params(name):
  if name == "cnn":
    from prophet_jax.models import get_model

    m = get_model("cnn")
    params = jax.eval_shape(m.init, jax.random.key(0))
    return params, list(m.forward_paths(params))
  from prophet_jax.models import architecture

  a = architecture(name)
  return a.abstract_params(), list(a.forward_paths())


def _ranks(x):
  """Average ranks (ties share their mean rank), as Spearman's coefficient uses."""
  x = np.asarray(x, float)
  order = np.argsort(x, kind="stable")
  ranks = np.empty(len(x))
  ranks[order] = np.arange(len(x), dtype=float)
  for v in np.unique(x):
    tie = x == v
    ranks[tie] = ranks[tie].mean()
  return ranks


def spearman(a, b):
  return float(np.corrcoef(_ranks(a), _ranks(b))[0, 1])


@pytest.fixture(scope="module", params=["cnn", "resnet50"])
def model(request):
  name = request.param
  params, fwd = _params(name)
  return name, params, fwd, _hlo(name), _xplane.read_trace(_trace(name), [STEP, UPDATE])


def test_gpu_trace_events_have_no_run_id_and_are_tied_to_the_host_launches(model):
  name, _, _, _, trace = model
  assert trace.platform == "gpu" and trace.device_name == "NVIDIA H200"
  assert trace.linked == {STEP: "host launch", UPDATE: "host launch"}
  assert trace.launches == {STEP: 3, UPDATE: 3}
  steps = _xplane.executions(trace.events[STEP])
  updates = _xplane.executions(trace.events[UPDATE])
  assert len(steps) == 3 and len(updates) == 3
  assert len({len(g) for g in steps}) == 1  # every step ran the same kernels
  # in time order, and each update ran between two steps (the boundaries the trace shows)
  for k in range(2):
    assert steps[k][-1]["end_ns"] <= updates[k][0]["start_ns"] <= updates[k][-1]["end_ns"] <= \
        steps[k + 1][0]["start_ns"]
  if name == "resnet50":
    assert sum(len(g) for g in steps) == 2190


def test_the_bug_reproduced_and_the_checks_refuse_it(model):
  """Two bugs made the H200 profiles: executions grouped by (run_id or the line's name, device) put
  every kernel in one group; and a leaf returned through a get-tuple-element of a tuple was read as
  ready when the whole tuple was (the last of ResNet-50's 161 gradients). Both reproduced here."""
  name, params, fwd, text, trace = model
  leaves = jax.tree_util.tree_leaves_with_path(params)
  paths = [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in leaves]
  n = len(paths)

  def run(events, hlo):
    return _xplane.analyse(events, hlo, list(range(n)), n, list(dict.fromkeys(layer_of(p) for p in fwd)),
                           expected=3, row_layers=[layer_of(p) for p in paths])

  hlo = _step_hlo.step_hlo(text)
  old_hlo = _step_hlo.step_hlo(text)
  for ins in old_hlo.instrs.values():
    ins.index = None  # the old reading: a get-tuple-element waits for its whole tuple
  old = [dict(e, run=f"{e['device']}/Stream #14(Memset,Compute)") for e in trace.events[STEP]]
  assert len(_xplane.executions(old)) == 1
  bad = run(old, old_hlo)
  assert "1 execution(s) found where 3 were traced" in bad.problems[0]
  one_instant = run(trace.events[STEP], old_hlo)
  if name == "resnet50":  # what the issue saw: 156 of 161 leaves ready within 0.3 us
    assert bad.executions == 1 and "ready within" in bad.problems[-1]
    assert len(one_instant.problems) == 1 and one_instant.problems[0].startswith("157 of 161 gradients")
  good = run(trace.events[STEP], hlo)
  assert good.problems == [] and good.executions == 3 and good.found == 3


def test_profile_from_trace_gives_a_plausible_gpu_profile(model):
  name, params, fwd, text, _ = model
  prof = profile_from_trace(_trace(name), text, params)
  assert prof.method == "measured" and prof.device == "NVIDIA H200"
  assert "3 executions" in prof.notes and "host's launches" in prof.notes
  n_leaves = len(jax.tree_util.tree_leaves(params))
  assert len(prof.rows) == n_leaves == {"cnn": 12, "resnet50": 161}[name]
  # exact sizes, every leaf once
  ref = GradientProfile.from_params(params)
  assert {(r.path, r.shape, r.dtype, r.nbytes) for r in prof.rows} == \
      {(r.path, r.shape, r.dtype, r.nbytes) for r in ref.rows}
  # backward between 1.2x and 3x forward (cnn 1.8x, ResNet-50 2.4x on the H200)
  assert 1.2 * prof.forward_s <= prof.backward_s <= 3 * prof.forward_s
  # a layer is ready when its last gradient is; backward runs back to front
  layer_ready = {}
  for r in prof.rows:
    layer_ready[r.layer] = max(layer_ready.get(r.layer, 0.0), r.ready_s)
  layers = list(dict.fromkeys(layer_of(p) for p in fwd))  # the model's own forward order
  times = [layer_ready[l] for l in layers]
  assert spearman(range(len(layers)), times) <= -0.9
  assert len(set(times)) >= 0.9 * len(layers)
  # the rows' priority order read from the compiled forward agrees with the jaxpr's layer order
  got_layers = list(dict.fromkeys(r.layer for r in prof.rows))
  assert sorted(got_layers) == sorted(layers)
  assert spearman([layers.index(l) for l in got_layers], range(len(layers))) >= 0.99
  assert prof.rows[0].layer == layers[0]
  # per-layer forward times sum to forward_s, and most layers got some
  assert sum(r.fwd_s for r in prof.rows) == pytest.approx(prof.forward_s)
  assert sum(1 for r in prof.rows if r.fwd_s > 0) >= 0.6 * len(layers)  # BatchNorms fused into convs: 0
  assert GradientProfile.from_json(prof.to_json()) == prof


def test_a_corrected_resnet50_profile_plans_overlap():
  """From the bug's profile `auto` sent one all-reduce after backward on 100gb-ib; a backward that
  lasts lets it overlap."""
  params, _ = _params("resnet50")
  prof = profile_from_trace(_trace("resnet50"), _hlo("resnet50"), params)
  sched = plan(prof, NetworkModel.preset("10gbe", workers=8), "auto")
  assert sched.num_allreduces > 1


def test_profile_from_trace_reads_a_directory_and_a_compiled_program(tmp_path):
  d = tmp_path / "plugins" / "profile" / "run"
  d.mkdir(parents=True)
  with gzip.open(_trace("cnn"), "rb") as f:
    (d / "host.xplane.pb").write_bytes(f.read())
  params, _ = _params("cnn")
  a = profile_from_trace(tmp_path, _hlo("cnn"), params)
  b = profile_from_trace(_trace("cnn"), _hlo("cnn"), params)
  assert [(r.path, r.ready_s) for r in a.rows] == [(r.path, r.ready_s) for r in b.rows]

  class Compiled:  # anything with as_text(), as a jax executable has
    def as_text(self):
      return _hlo("cnn")

  assert profile_from_trace(_trace("cnn"), Compiled(), params).backward_s == b.backward_s


def test_profile_from_trace_refuses_an_implausible_trace(monkeypatch):
  """Executions that do not match the host's launches: ProfileError saying what the trace held."""
  merge_runs(monkeypatch)   # the old bug: every step in one run
  params, _ = _params("cnn")
  with pytest.raises(ProfileError, match=r"implausible trace: 1 execution\(s\) found where 3 were traced \(3 "
                                         r"host launches x 1 devices\).*held 177 op events"):
    profile_from_trace(_trace("cnn"), _hlo("cnn"), params)


def test_profile_from_trace_bad_input_is_named(tmp_path):
  params, _ = _params("cnn")
  r50, _ = _params("resnet50")
  with pytest.raises(FileNotFoundError, match="no such file"):
    profile_from_trace(tmp_path / "nothing", _hlo("cnn"), params)
  with pytest.raises(FileNotFoundError, match="holds no .xplane.pb"):
    profile_from_trace(tmp_path, _hlo("cnn"), params)
  for name, data in (("notes.xplane.pb", b"this is a text file\n"), ("random.xplane.pb", bytes(range(256)) * 4),
                     ("bad.xplane.pb.gz", b"not gzip")):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(ProfileError, match=rf"trace '.*{re.escape(name)}' is not a profiler trace.*"
                                           r"jax.profiler.trace\(dir\) writes"):
      profile_from_trace(tmp_path / name, _hlo("cnn"), params)
  small = {"params": {"Conv_0": {"bias": np.zeros(16, np.float32), "kernel": np.zeros((2, 2), np.float32)}}}
  with pytest.raises(ValueError, match=r"has 12 outputs; they do not match the 2 floating leaves.*leaf "
                                       r"'params/Conv_0/kernel' \(float32\[2, 2\]\) meets output 1, "
                                       r"f32\[3,3,3,16\]"):
    profile_from_trace(_trace("cnn"), _hlo("cnn"), small)
  with pytest.raises(ValueError, match=r"outputs hold the shapes of the 1 leaves of params at 2 places"):
    profile_from_trace(_trace("cnn"), _hlo("cnn"), {"b": np.zeros(16, np.float32)})
  with pytest.raises(ValueError, match=r"leaf 'params/bn1/bias' \(float32\[64\]\) meets output 0, f32\[16\]"):
    profile_from_trace(_trace("cnn"), _hlo("cnn"), r50)
  other = _hlo("cnn").replace("HloModule jit_prophet_profile_step", "HloModule jit_missing", 1)
  with pytest.raises(ProfileError, match=r"no events of module 'jit_missing'.*trace holds "
                                         r"'jit_prophet_profile_step' \(177 events\)"):
    profile_from_trace(_trace("cnn"), other, params)
  with pytest.raises(ValueError, match=r"hlo_text is not HLO module text \(it starts 'not hlo'\)"):
    profile_from_trace(_trace("cnn"), "not hlo", params)
  with pytest.raises(TypeError, match="expected a compiled jax executable or HLO text"):
    profile_from_trace(_trace("cnn"), 42, params)
  with pytest.raises(ProfileError, match="no floating-point leaves"):
    profile_from_trace(_trace("cnn"), _hlo("cnn"), {"n": np.zeros(3, np.int32)})


# --------------------------------------------------------------------------------------------------
# Synthetic traces: several GPUs, a collective on its own stream, no host events


def _xspace(planes):
  """Serialized XSpace from {plane: {line: [(name, start_ns, dur_ns, {stat: value})]}}."""
  stat_ids, ev_ids, out = {}, {}, []
  for pid, (plane, lines) in enumerate(planes.items(), 1):
    stat_ids.clear()
    ev_ids.clear()
    body = []
    for lid, (line, events) in enumerate(lines.items(), 1):
      evs = []
      for name, start, dur, stats in events:
        eid = ev_ids.setdefault(name, len(ev_ids) + 1)
        st = []
        for k, v in stats.items():
          sid = stat_ids.setdefault(k, len(stat_ids) + 1)
          val = f'str_value: "{v}"' if isinstance(v, str) else f"int64_value: {int(v)}"
          st.append(f"stats {{ metadata_id: {sid} {val} }}")
        evs.append(f"events {{ metadata_id: {eid} offset_ps: {int(start * 1000)} duration_ps: "
                   f"{int(dur * 1000)} {' '.join(st)} }}")
      body.append(f'lines {{ id: {lid} name: "{line}" timestamp_ns: 0 {" ".join(evs)} }}')
    meta = [f'event_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}' for n, i in ev_ids.items()]
    meta += [f'stat_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}' for n, i in stat_ids.items()]
    out.append(f'planes {{ id: {pid} name: "{plane}" {" ".join(body)} {" ".join(meta)} }}')
  return jax.profiler.ProfileData.text_proto_to_serialized_xspace(" ".join(out))


def _two_gpu_trace(with_host=True, device_threads=False):
  """Two steps of 'jit_s' on 2 GPUs: compute on one stream, the all-reduce on another, and an update
  program 'jit_u' between the steps; the host launches each step once (run_id 11, 12)."""
  planes, host, corr = {}, [], 100
  for g in range(2):
    comp, coll = [], []
    for step, t0 in enumerate((1000, 5000)):
      for k, (op, dt) in enumerate((("f", 0), ("b", 300), ("ar", 600))):
        corr += 1
        ev = (op, t0 + dt + 10 * g, 250, {"hlo_module": "jit_s", "hlo_op": op, "correlation_id": corr,
                                          "program_id": 1})
        (coll if op == "ar" else comp).append(ev)
        host.append((f"launch {op}", t0 - 500 + k * 10 + g, 5, {"correlation_id": corr}))
      comp.append(("u", t0 + 2000, 100, {"hlo_module": "jit_u", "hlo_op": "u", "program_id": 2}))
    planes[f"/device:GPU:{g}"] = {"Stream #7(Compute)": comp, "Stream #9(Nccl)": coll}
  scopes = [("Execute (jit_s)", t0 - 600, 400, {"run_id": rid, "name": "jit_s"})
            for rid, t0 in ((11, 1000), (12, 5000))]
  if with_host and not device_threads:
    planes["/host:CPU"] = {"python3": sorted(scopes + host, key=lambda e: e[1])}
  elif with_host:  # each GPU's kernels launched from its own thread, inside the caller's Execute
    planes["/host:CPU"] = {"python3": scopes,
                           **{f"gpu{g} thread": [h for h in host if h[1] % 2 == g] for g in range(2)}}
  return _xspace(planes)


def test_several_gpus_each_execution_keeps_its_collective_stream(tmp_path):
  f = tmp_path / "t.xplane.pb"
  f.write_bytes(_two_gpu_trace())
  t = _xplane.read_trace(f, ["jit_s"])
  assert t.linked == {"jit_s": "host launch"} and t.launches == {"jit_s": 2}
  ex = _xplane.executions(t.events["jit_s"])
  assert len(ex) == 4  # 2 steps x 2 devices
  for g in ex:
    assert [e["op"] for e in g] == ["f", "b", "ar"]  # the all-reduce's stream stays with its step
    assert len({e["device"] for e in g}) == 1 and len({e["run"] for e in g}) == 1
  assert {e["run"] for e in ex[0]} != {e["run"] for e in ex[-1]}


def test_launches_from_per_device_threads_find_the_execute_event_on_the_calling_thread(tmp_path):
  f = tmp_path / "t.xplane.pb"
  f.write_bytes(_two_gpu_trace(device_threads=True))
  t = _xplane.read_trace(f, ["jit_s"])
  assert t.linked == {"jit_s": "host launch"}
  ex = _xplane.executions(t.events["jit_s"])
  assert len(ex) == 4 and all([e["op"] for e in g] == ["f", "b", "ar"] for g in ex)
  assert sorted({g[0]["run"][1] for g in ex}) == [11, 12]


def test_without_host_events_a_device_is_cut_where_another_program_ran(tmp_path):
  f = tmp_path / "t.xplane.pb"
  f.write_bytes(_two_gpu_trace(with_host=False))
  t = _xplane.read_trace(f, ["jit_s"])
  assert t.linked == {"jit_s": "segments"} and t.launches == {}
  ex = _xplane.executions(t.events["jit_s"])
  assert len(ex) == 4 and all([e["op"] for e in g] == ["f", "b", "ar"] for g in ex)


def test_cpu_events_keep_their_run_id():
  ev = [{"op": "a", "start_ns": float(t), "end_ns": t + 1.0, "run": r, "device": d}
        for t, r, d in ((0, 1, 0), (1, 1, 1), (2, 2, 0), (3, 2, 1), (4, 1, 0))]
  ex = _xplane.executions(ev)
  assert [[(e["run"], e["device"]) for e in g] for g in ex] == [[(1, 0), (1, 0)], [(1, 1)], [(2, 0)], [(2, 1)]]


def test_a_partial_execution_is_dropped_and_said_so():
  text = _hlo("cnn")
  hlo = _step_hlo.step_hlo(text)
  t = _xplane.read_trace(_trace("cnn"), [STEP])
  ev = t.events[STEP]
  first_run = ev[0]["run"]
  cut = [e for i, e in enumerate(ev) if e["run"] != first_run or i >= 40]  # the profiler began late
  params, fwd = _params("cnn")
  paths = [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in
           jax.tree_util.tree_leaves_with_path(params)]
  an = _xplane.analyse(cut, hlo, list(range(12)), 12, list(dict.fromkeys(layer_of(p) for p in fwd)),
                       row_layers=[layer_of(p) for p in paths])
  assert an.found == 3 and an.executions == 2 and an.problems == []
  assert "1 execution(s) with under 90% of the typical 59 ops dropped" in an.held
