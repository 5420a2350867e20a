"""XLA:GPU without a GPU: every rewrite compiled for 8 compile-only H100s, and the compiled schedule audited.

Each step is built the way a user writes it (`jax.jit(jax.shard_map(...))` over `gpu_topology("h100")`'s
mesh, lowered on ShapeDtypeStructs, `prophet_jax.lower_step`) and compiled by XLA:GPU's whole
pipeline (combiner, all-reduce-contiguous, async collectives, latency hiding scheduler, ptxas). Nothing
runs. The claims, per model (cnn, gpt-tiny) x policy x {scheduled, hooked, pipelined}:
- the audit is OK: one all-reduce per chunk, planned sizes, schedule order (the loss pmean that XLA:GPU
  concatenates into the last chunk's all-reduce is read through and listed as foreign);
- once the chunks' all-reduces begin, every remaining backward matmul/convolution is scheduled inside an
  all-reduce window; for plans of whole layers on the cnn, every chunk but the last has backward compute
  inside its own window (finer plans can leave a chunk exposed when the next chunk's gradients came out
  of the same kernel: XLA fuses gpt-tiny's q/k/v weight gradients into one gemm, priority cuts one leaf
  into several chunks);
- in the pipelined step, the next step's forward is scheduled inside an all-reduce window exactly when
  the last chunk does not hold the parameters the forward reads first.
And: a plain pmean is one all-reduce with nothing overlapped; a step built to be merged, or reordered,
fails the audit; users' XLA flags keep the guarantees (or the audit warns why the overlap is gone).

Compiles are shared: policies with the same chunks (up to the order of slices inside a chunk) compile
to the same program, compiled once, two at a time (compilation releases the GIL). No test is skipped:
without the gpu-compile extra the `topo` fixture raises GpuCompileError saying how to install it.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import prophet_jax as pj
from prophet_jax._compiled import _gpu
from prophet_jax._rewrite._collectives import chunk_scope
from prophet_jax.models import get_model

AX = "data"
NDEV = 8
# two examples per device: with one, a Dense layer's weight gradient is an outer product that XLA emits
# as an elementwise fusion, not a matmul, and its cost model then leaves a cnn convolution outside every
# window (measured); the claims below are about XLA's schedule of real matmuls
BATCH = 16
MODELS = ("cnn", "gpt-tiny")
POLICIES = ("wfbp", "bucket", "xla", "mgwfbp", "priority", "prophet", "auto")
MODES = ("scheduled", "hooked", "pipelined")
# priority: partitions smaller than the cnn's large leaves, and a credit that makes it reorder
OPTIONS = {"priority": {"partition_bytes": 16384, "credit_bytes": 16384}}
# the parameters the forward pass reads first: until they are reduced, none of the next forward can run
FIRST_READ = {"cnn": ("params/Conv_0/",), "gpt-tiny": ("params/wte/", "params/wpe/")}
WHOLE_LAYER_POLICIES = ("wfbp", "mgwfbp", "prophet", "auto")
# A fast link on which merging never pays: mgwfbp, prophet and auto plan per layer like wfbp, bucket and
# xla one chunk (every layer merged), priority splits leaves: three programs per model and mode.
# The cnn runs the full product policy x mode. A gpt-tiny compile costs ~5 CPU-seconds (the cnn's ~1.5),
# so gpt-tiny runs a cover in which every policy and every mode appear (STYLE.md's pairwise cover; one
# program per mode): its 19-chunk per-layer plans pipelined, priority's 40 split-leaf chunks hooked (the
# hook groups), one chunk scheduled. bench/gpu_hlo.py compiles the full product for every model.
CASES = {("cnn", mode): POLICIES for mode in MODES}
CASES.update({("gpt-tiny", "scheduled"): ("bucket", "xla"), ("gpt-tiny", "hooked"): ("priority",),
              ("gpt-tiny", "pipelined"): ("wfbp", "mgwfbp", "prophet", "auto")})
NETWORK = pj.NetworkModel(alpha_s=1e-7, beta_s_per_byte=1e-10, workers=NDEV, name="fast")
# On that link priority sends everything as it becomes ready, the front layers last, so no next forward
# can start early. On 10gbe, with a small credit, it holds back-layer partitions behind the front
# layers' (the reordering the pipelined step exists for): one more pipelined plan per model.
SLOW = pj.NetworkModel.preset("10gbe", workers=NDEV)
SLOW_OPTIONS = {"partition_bytes": 16384, "credit_bytes": 16384}


# jaxlib >= 0.12's XLA:GPU runs an all-reduce of up to a few MiB on one host as a one-shot Triton kernel
# (an asynchronous collective fusion, `fusion-start`), and its scheduler puts little or nothing inside
# those windows in these tiny models; larger all-reduces (>= 16 MiB measured) take the NCCL path, which
# jaxlib 0.10 takes for every size (docs/facts.md, "XLA:GPU 0.12's collective kernels"). The overlap
# claims below are about the NCCL path: where this jaxlib has collective kernels, the audited programs
# are compiled with them off (the option's empty list); `test_default_flags_...` audits the default.
pytestmark = pytest.mark.gpu  # compile-only XLA:GPU: the gpu-compile extra, no GPU

NCCL_PATH = ({"xla_gpu_experimental_use_collective_kernels": ""}
             if _gpu.xla_option_accepted("xla_gpu_experimental_use_collective_kernels", "") else {})


@functools.lru_cache(maxsize=None)
def schedule_for(model: str, policy: str, mode: str) -> pj.Schedule:
  """The plan of `policy` ('priority@10gbe': priority on the slow link, pipelined only)."""
  params = get_model(model).abstract_params()
  profile = pj.GradientProfile.from_params(params, forward_s=1e-3, backward_s=2e-3)
  if policy == "priority@10gbe":
    return pj.plan(profile, SLOW, "priority", cross_step=True, **SLOW_OPTIONS)
  return pj.plan(profile, NETWORK, policy, cross_step=mode == "pipelined",
                 **OPTIONS.get(policy, {}))


def program_key(s: pj.Schedule) -> tuple:
  """Schedules with equal keys compile to the same program (the order of slices inside a chunk only
  permutes the chunk's buffer)."""
  return tuple(tuple(sorted(c.slices)) for c in s.chunks)


def _cases():
  """(model, mode, policy) of every audited step (the cnn's pipelined ones with priority@10gbe)."""
  for (model, mode), policies in CASES.items():
    extra = ("priority@10gbe",) if (model, mode) == ("cnn", "pipelined") else ()
    for policy in policies + extra:
      yield model, mode, policy


@pytest.fixture(scope="module")
def reports(topo):
  """(model, mode, policy) -> AuditReport, and ('cnn', 'pmean') -> the plain step's; each distinct
  program lowered once and compiled two at a time."""
  lowered, key_of = {}, {}
  for model, mode, policy in _cases():
    s = schedule_for(model, policy, mode)
    key = (model, mode, program_key(s))
    if key not in lowered:
      lowered[key] = pj.lower_step(get_model(model), s, mode, topo, batch_size=BATCH)
    key_of[(model, mode, policy)] = key
  # the plain step (one model is enough; bench/gpu_hlo.py has the others)
  lowered[("cnn", "pmean")] = pj.lower_step(get_model("cnn"), schedule_for("cnn", "wfbp", "scheduled"),
                                              "pmean", topo, batch_size=BATCH)
  key_of[("cnn", "pmean")] = ("cnn", "pmean")
  keys = list(lowered)
  with ThreadPoolExecutor(2) as pool:
    texts = dict(zip(keys, pool.map(lambda k: lowered[k].compile(compiler_options=NCCL_PATH).as_text(),
                                    keys)))
  out = {}
  for name, key in key_of.items():
    model, mode, policy = name if len(name) == 3 else ("cnn", "scheduled", "wfbp")
    out[name] = pj.audit(texts[key], schedule_for(model, policy, mode))
  return out


@pytest.mark.parametrize("model,mode", list(CASES))
def test_every_policy_keeps_its_chunks_and_overlaps_backward(reports, model, mode):
  for policy in CASES[(model, mode)]:
    s = schedule_for(model, policy, mode)
    r = reports[(model, mode, policy)]
    where = f"{model} {mode} {policy}\n{r.describe()}"
    assert r.ok, where
    assert r.order == tuple(range(s.num_allreduces)), where
    assert [e.elements for e in r.chunks] == [c.size for c in s.chunks], where
    assert r.max_in_flight <= 1, where  # the tie chain, and XLA:GPU's own default limit
    if mode != "pipelined":  # the user's loss pmean, read through XLA:GPU's concatenation
      assert [(e.elements, e.shared) for e in r.foreign] == [(1, True)], where
    else:
      assert not r.foreign, where
    if s.num_allreduces > 1:
      assert r.asynchronous and r.max_in_flight == 1, where
      assert r.backward_outside_windows == 0, where
      split = any(b - a < math.prod(s.rows[row][1]) for c in s.chunks for row, a, b in c.slices)
      if model == "cnn" and policy in WHOLE_LAYER_POLICIES and not split:
        overlapped = [e.chunk for e in r.chunks if e.window_ops("backward")]
        assert set(range(s.num_allreduces - 1)) <= set(overlapped), where


def test_default_flags_keep_count_and_order_and_the_audit_says_which_form_it_read(topo):
  """The pipelined cnn step under XLA's defaults: jaxlib 0.10's XLA:GPU writes every chunk as an
  all-reduce-start/done pair and overlaps all but the last; jaxlib 0.12's writes them as collective
  kernels (fusion-start) and leaves chunk 0's window empty, which the audit reads, counts and warns about
  (docs/facts.md, "XLA:GPU 0.12's collective kernels")."""
  s = schedule_for("cnn", "wfbp", "pipelined")
  r = pj.audit(pj.lower_step(get_model("cnn"), s, "pipelined", topo, batch_size=BATCH).compile(), s)
  assert r.ok and r.order == tuple(range(s.num_allreduces)) and r.max_in_flight == 1, r.describe()
  kernel_warning = [w for w in r.warnings if "collective kernels" in w]
  if NCCL_PATH:  # this jaxlib has collective kernels
    assert r.forms == {"fusion-start": s.num_allreduces}, r.describe()
    assert "fusion-start/done (async collective fusion)" in r.describe()
    assert 0 in r.exposed and kernel_warning, r.describe()
    assert "--xla_gpu_experimental_use_collective_kernels=-ALL_REDUCE" in kernel_warning[0]
  else:
    assert r.forms == {"all-reduce-start": s.num_allreduces}, r.describe()
    assert not r.exposed[:-1] and not kernel_warning, r.describe()


@pytest.mark.parametrize("model", MODELS)
def test_pipelined_next_forward_runs_inside_an_allreduce_window_when_the_plan_allows(reports, model):
  allowed_any = False
  for policy in CASES[(model, "pipelined")] + (("priority@10gbe",) if model == "cnn" else ()):
    s = schedule_for(model, policy, "pipelined")
    r = reports[(model, "pipelined", policy)]
    last_paths = {s.rows[row][0] for row, _, _ in s.chunks[-1].slices}
    allowed = not any(p.startswith(FIRST_READ[model]) for p in last_paths)
    allowed_any |= allowed
    assert bool(r.forward_overlap) == allowed, f"{policy}: {r.describe()}"
  assert allowed_any, "no plan lets the next forward start early: the claim was not exercised"


def test_the_suites_backend_optimisation_level_leaves_the_gpu_hlo_and_its_audit_unchanged(topo):
  """tests/conftest.py sets XLA's backend optimisation level 0 for the suite: the scheduled HLO XLA:GPU
  writes (and the audit reads) is byte for byte level 3's (XLA's default), windows included."""
  s = schedule_for("cnn", "wfbp", "pipelined")
  lowered = pj.lower_step(get_model("cnn"), s, "pipelined", topo, batch_size=BATCH)
  texts = [lowered.compile(compiler_options={**NCCL_PATH, "xla_backend_optimization_level": level}).as_text()
           for level in (0, 3)]
  assert texts[0] == texts[1]
  r = pj.audit(texts[0], s)
  assert r.ok and r.asynchronous and r.backward_outside_windows == 0, r.describe()


def test_plain_pmean_is_one_allreduce_with_nothing_overlapped(reports):
  r = reports[("cnn", "pmean")]
  assert not r.ok and r.chunk_allreduces == 0
  assert len({e.name for e in r.foreign}) == 1  # every gradient (and the loss) in one all-reduce
  n_leaves = len(jax.tree.leaves(get_model("cnn").abstract_params()))
  assert len(r.foreign) == n_leaves + 1
  assert not any(e.overlapped for e in r.foreign)


def _handmade_step(s, order, tie):
  """The scheduled all-reduce written by hand: chunks in `order`, each under its chunk scope, tied (or
  not) to the previous one's result."""

  def allreduce(g):
    flat = jnp.concatenate([x.reshape(-1) for x in jax.tree.leaves(g)])
    out, prev = [], None
    offs = [0]
    for c in s.chunks:
      offs.append(offs[-1] + c.size)
    for k in order:
      with jax.named_scope(chunk_scope(k)):
        buf = flat[offs[k]:offs[k + 1]]
        if tie and prev is not None:
          buf = buf.at[0].add(prev[0] * 0)
        red = jax.lax.psum(buf, AX)
      out.append(red)
      prev = red
    return sum(jnp.sum(x) for x in out)

  return allreduce


@pytest.mark.parametrize("case", ["merged", "reordered"])
def test_a_step_xla_merged_or_reordered_fails_the_audit(topo, case):
  m = get_model("cnn")
  s = schedule_for("cnn", "wfbp", "scheduled")
  n = s.num_allreduces
  order = list(range(n)) if case == "merged" else [1, 0] + list(range(2, n))
  f = _handmade_step(s, order, tie=case == "reordered")
  params = m.abstract_params()
  # chunk sizes must add up to the flattened tree for the slicing above
  assert sum(c.size for c in s.chunks) == sum(x.size for x in jax.tree.leaves(params))
  step = jax.jit(jax.shard_map(lambda p: f(jax.lax.pcast(p, AX, to="varying")), mesh=topo.mesh(AX),
                               in_specs=(P(),), out_specs=P()))
  r = pj.audit(step.lower(topo.abstract(params, P())).compile(), s)
  assert not r.ok, r.describe()
  if case == "merged":  # independent all-reduces: XLA:GPU's combiner joins them into one
    assert any("share one all-reduce" in p for p in r.problems), r.describe()
    assert len({e.name for e in r.chunks}) == 1
  else:
    assert any("not in schedule order" in p for p in r.problems), r.describe()
    assert r.order[:2] == (1, 0)


# users' flags, as per-compile options (an unknown name in XLA_FLAGS would abort the process). Each of
# the benign two alone compiles to the same schedule as the default (bench/gpu_ordering.py); together
# they are one compile here. The latency hiding scheduler off did nothing on an H100 target in jaxlib
# 0.10.2 and makes the all-reduces synchronous in 0.12: either way count and order hold, and the audit
# warns where nothing can overlap.
# jaxlib 0.12 replaced the boolean xla_gpu_enable_pipelined_all_reduce by the mode
# xla_gpu_pipeline_all_reduce (the old name is refused as a compile option there).
PIPELINED_ALL_REDUCE = (("xla_gpu_enable_pipelined_all_reduce", True)
                        if _gpu.xla_option_accepted("xla_gpu_enable_pipelined_all_reduce", True)
                        else ("xla_gpu_pipeline_all_reduce", "COLLECTIVE_PIPELINING_MODE_ON"))
BENIGN_FLAGS = {"xla_gpu_all_reduce_combine_threshold_bytes": 1 << 30,
                PIPELINED_ALL_REDUCE[0]: PIPELINED_ALL_REDUCE[1], **NCCL_PATH}
LHS_OFF_FLAGS = {"xla_gpu_enable_latency_hiding_scheduler": False, **NCCL_PATH}
SYNC_FLAGS = {"xla_gpu_disable_async_collectives": "ALLREDUCE", **NCCL_PATH}


def test_users_xla_flags_keep_count_and_order_or_warn(topo):
  m = get_model("cnn")
  s = schedule_for("cnn", "wfbp", "hooked")
  lowered = pj.lower_step(m, s, "hooked", topo, batch_size=BATCH)
  with ThreadPoolExecutor(2) as pool:
    benign, lhs_off, sync = pool.map(lambda o: pj.audit(lowered.compile(compiler_options=o), s),
                                     (BENIGN_FLAGS, LHS_OFF_FLAGS, SYNC_FLAGS))
  for r in (benign, lhs_off, sync):
    assert r.ok and r.order == tuple(range(s.num_allreduces)), r.describe()
  assert not benign.exposed[:-1] and not benign.warnings and benign.backward_outside_windows == 0, \
      benign.describe()
  assert not sync.asynchronous and len(sync.exposed) == s.num_allreduces
  assert any("synchronous" in w for w in sync.warnings), sync.describe()
  if lhs_off.asynchronous:  # jaxlib 0.10.2: the flag does nothing on Hopper
    assert not lhs_off.exposed[:-1] and not lhs_off.warnings, lhs_off.describe()
  else:  # jaxlib 0.12: synchronous, and said so
    assert any("synchronous" in w and "latency_hiding_scheduler" in w for w in lhs_off.warnings), \
        lhs_off.describe()


def test_a100_overlaps_only_with_the_latency_hiding_scheduler():
  """XLA:GPU (jaxlib 0.10.2 and 0.12) schedules for overlap by default only on Hopper: on an A100 the
  chunks' all-reduces compile synchronous (the audit warns) unless the user turns the scheduler on."""
  a100 = pj.gpu_topology("a100", devices=NDEV)
  m = get_model("cnn")
  s = schedule_for("cnn", "wfbp", "hooked")
  lowered = pj.lower_step(m, s, "hooked", a100, batch_size=BATCH)
  with ThreadPoolExecutor(2) as pool:
    default, lhs = pool.map(lambda o: pj.audit(lowered.compile(compiler_options=o), s),
                            (None, {"xla_gpu_enable_latency_hiding_scheduler": True}))
  assert default.ok and not default.asynchronous and default.warnings, default.describe()
  assert "xla_gpu_enable_latency_hiding_scheduler=true" in default.warnings[0]
  assert lhs.ok and lhs.asynchronous and not lhs.warnings and not lhs.exposed[:-1], lhs.describe()


def test_audit_report_round_trips_through_json(reports):
  r = reports[("cnn", "pipelined", "priority")]
  back = pj.AuditReport.from_json(r.to_json())
  assert back == r and back.exposed == r.exposed and back.forward_overlap == r.forward_overlap
  with pytest.raises(ValueError, match="unknown field"):
    pj.AuditReport.from_json({**json.loads(r.to_json()), "nope": 1})
  with pytest.raises(ValueError, match="schema"):
    pj.AuditReport.from_json({**json.loads(r.to_json()), "schema": 99})


# --------------------------------------------------------------------------------------------------
# targets, errors, the command line


def test_shipped_targets():
  assert pj.GPU_TARGETS == ("h100", "a100", "v100")
  h100, a100, v100 = (pj.gpu_target(t) for t in pj.GPU_TARGETS)
  assert (h100.compute_capability, a100.compute_capability, v100.compute_capability) == ("9.0", "8.0",
                                                                                          "7.0")
  assert "H100" in h100.description and "A100" in a100.description and "V100" in v100.description
  assert 60e12 < h100.peak_flops < 70e12 and 19e12 < a100.peak_flops < 20e12  # FP32 CUDA cores
  assert pj.gpu_target("H100-SXM") == h100
  with pytest.raises(ValueError, match=r"unknown GPU target 'b200'.*'h100', 'a100', 'v100'"):
    pj.gpu_target("b200")
  with pytest.raises(ValueError, match=r"`devices` must be an integer >= 1.*number of GPUs"):
    pj.gpu_topology("h100", devices=0)


def test_abstract_places_on_the_axis_the_spec_names(topo):
  """issue 46: after topo.mesh("dp"), topo.abstract(x, P("dp")) used its own default axis 'data' (jax's
  "Resource axis: dp ... not found in mesh: ('data',)"); the axis now follows the spec."""
  mesh = topo.mesh("dp")
  x = jax.ShapeDtypeStruct((16, 4), jnp.float32)
  got = topo.abstract({"x": x, "y": x}, {"x": P("dp"), "y": P()})
  assert got["x"].sharding.mesh == mesh and got["y"].sharding.mesh == mesh and got["x"].sharding.spec == P("dp")
  assert topo.abstract(x, P(), axis_name="dp").sharding.mesh == mesh
  with pytest.raises(ValueError, match=r"spec names axis 'dp'.*Pass axis_name='dp', or mesh="):
    topo.abstract(x, P("dp"), axis_name="data")
  with pytest.raises(ValueError, match=r"names the axes \['a', 'b'\].*Pass mesh="):
    topo.abstract(x, P(("a", "b")))


def test_v100_compiles_with_cuda12_and_cuda13_says_it_cannot(topo, monkeypatch):
  """CUDA 13 dropped Volta: with jax-cuda13-plugin, gpu_topology('v100') says so and what to install;
  with jax-cuda12-plugin the V100 target compiles. Both answers are checked whichever plugin is here:
  the refusal with the plugin's CUDA major faked to 13 where the installed one is 12."""
  del topo  # the plugin is checked there
  plugin = _gpu.cuda_plugin()
  assert plugin is not None and _gpu.CUDA_MAJORS["v100"] == (12,)
  if plugin.major == 12:
    v100 = pj.gpu_topology("v100", devices=2)
    assert len(v100.devices) == 2 and "V100" in v100.devices[0].device_kind
    fake = _gpu.CudaPlugin(major=13, plugin="jax-cuda13-plugin", pjrt="jax-cuda13-pjrt")
    monkeypatch.setattr(_gpu, "cuda_plugin", lambda: fake)
    monkeypatch.setattr(_gpu, "_version", lambda dist: __import__("jaxlib").__version__)
  with pytest.raises(pj.GpuCompileError, match=r"gpu_topology\('v100'\).*jax-cuda13-plugin \(CUDA 13\).*"
                     r"compute capability 7\.0.*CUDA 13 dropped Volta.*prophet-jax\[gpu-compile\].*"
                     r"\['h100', 'a100'\]"):
    pj.gpu_topology("v100", devices=2)
  assert pj.gpu_topology("h100", devices=2).target.name == "h100"  # a target CUDA 13 supports


def test_missing_plugin_ptxas_or_platform_say_what_to_do(monkeypatch):
  monkeypatch.setattr(_gpu, "_plugins_found", lambda: ())
  assert not _gpu.cuda_plugin_installed()
  with pytest.raises(pj.GpuCompileError, match=r"not installed.*prophet-jax\[gpu-compile\]' for CUDA 12.*"
                     r"prophet-jax\[gpu-compile-cuda13\]' for CUDA 13"):
    pj.gpu_topology("h100")
  monkeypatch.undo()
  monkeypatch.setattr(_gpu, "find_ptxas", lambda: None)
  wheel = {12: "nvidia-cuda-nvcc-cu12", 13: "nvidia-cuda-nvcc "}[_gpu.cuda_plugin().major]
  with pytest.raises(pj.GpuCompileError, match=f"no ptxas found.*pip install {wheel}"):
    pj.gpu_topology("h100")
  monkeypatch.undo()
  monkeypatch.setattr(_gpu, "_plugins_found", lambda: (12, 13))
  with pytest.raises(pj.GpuCompileError, match="both jax-cuda12-plugin and jax-cuda13-plugin.*keep one"):
    pj.gpu_topology("h100")
  monkeypatch.undo()
  before = jax.config.jax_platforms
  jax.config.update("jax_platforms", None)
  try:
    with pytest.raises(pj.GpuCompileError, match="JAX_PLATFORMS is not set.*JAX_PLATFORMS=cpu"):
      pj.gpu_topology("h100")
  finally:
    jax.config.update("jax_platforms", before)


def test_cli_audit_in_a_process_without_jax_platforms_is_clean(tmp_path):
  """`prophet-jax audit` where the environment does not pin jax: the CLI pins it (no GPU driver here),
  and neither the plugin's 'Unable to load CUDA' traceback nor its driver-search lines reach stderr."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  out = subprocess.run([sys.executable, "-m", "prophet_jax", "audit", "--target", "h100", "--model",
                        "cnn", "--policy", "wfbp", "--mode", "hooked", "--batch", "16", "--json"],
                       capture_output=True, text=True, timeout=300, env=env)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stderr == "", out.stderr[-2000:]
  obj = json.loads(out.stdout)
  assert obj["target"] == "h100" and obj["report"]["ok"]
  report = pj.AuditReport.from_json(obj["report"])
  assert report.order == tuple(range(6)) and not report.exposed[:-1]
  bad = subprocess.run([sys.executable, "-m", "prophet_jax", "audit", "--target", "b200"],
                       capture_output=True, text=True, timeout=120, env=env)
  assert bad.returncode == 2 and "unknown GPU target 'b200'" in bad.stderr


def test_cli_pins_jax_to_the_cpu_only_where_the_plugin_cannot_load():
  from prophet_jax._values._config import default_jax_platforms

  assert default_jax_platforms({}, cuda_plugin=True, nvidia_driver=False) == "cpu"
  assert default_jax_platforms({}, cuda_plugin=True, nvidia_driver=True) is None  # a GPU machine
  assert default_jax_platforms({}, cuda_plugin=False, nvidia_driver=False) is None  # no plugin: no noise
  assert default_jax_platforms({"JAX_PLATFORMS": ""}, cuda_plugin=True, nvidia_driver=False) is None
