"""xla_options: a plan as XLA settings for a plain step, checked against the installed jaxlib.

One small model x one compile-only target: the `cnn`'s plain `pmean` step compiled for 8 H100s with the
options of a threshold-shaped plan (Horovod-style buckets of at most 40,000 bytes: 3 units) forms the
plan's 3 all-reduces (XLA alone merges the 12 gradients into one). bench/xla_options.py has the matrix
(the lossless all-reduce policies on cnn, gpt-tiny and the ResNet-50 and BERT-base shapes; H100 and A100;
both JAX lines for cnn and ResNet-50).
"""

from __future__ import annotations

import json
import pytest

import prophet_jax as pj
from prophet_jax import cli, models
from prophet_jax._compiled import _xla_options
from prophet_jax._compiled._hlo import hlo_text, parse_hlo, shape_bytes
from prophet_jax._compiled._hlo_collectives import allreduces

NET = pj.NetworkModel.preset("10gbe", workers=8)


@pytest.fixture(scope="module")
def cnn_plan():
  model = models.get_model("cnn")
  profile = pj.GradientProfile.from_params(model.abstract_params(), forward_s=1e-3, backward_s=2e-3, model="cnn")
  schedule = pj.plan(profile, NET, "bucket", style="horovod", bucket_bytes=40_000, cycle_s=1.0)
  assert schedule.allreduce_nbytes() == (11_048, 36_992, 29_632)   # layers (Dense_1+Dense_0), Conv_3, Conv_2..0
  return model, schedule


def test_a_threshold_shaped_plan_compiles_to_its_units(cnn_plan):
  from prophet_jax._steps import compile_step

  model, schedule = cnn_plan
  try:
    topo = pj.gpu_topology("h100", devices=8)
  except pj.GpuCompileError as e:
    pytest.fail(f"{e}\nThe test extra includes gpu-compile: run `make test`.", pytrace=False)
  options = pj.xla_options(schedule, NET, target=topo)
  assert options["xla_gpu_all_reduce_combine_threshold_bytes"] == 40_000       # the cap it filled to
  assert options["xla_gpu_enable_latency_hiding_scheduler"] is True
  assert options["xla_gpu_experimental_collective_start_as_early_as_possible"] is True  # 3 units overlap
  compiled, _ = compile_step(model, schedule, "pmean", topo, compiler_options=options)   # accepted
  got = sorted(shape_bytes(op.shape) for op in allreduces(parse_hlo(hlo_text(compiled))))
  got = [b for b in got if b > 4]                        # the user's loss pmean, if it stayed alone
  # the plan's count; XLA merges in its own gradient order, not leaf order, so a boundary may move by a
  # bias (measured on jax 0.10.2: 29,760 / 36,864 / 11,048 bytes); XLA alone makes one all-reduce
  assert len(got) == schedule.num_allreduces == 3, got
  assert sum(got) - sum(schedule.allreduce_nbytes()) in (0, 4), got
  assert max(got) <= 40_000, got


def test_refused_spellings_are_left_out_and_noted(cnn_plan, monkeypatch):
  _, schedule = cnn_plan
  monkeypatch.setattr(_xla_options, "_SCHEDULER", ("xla_gpu_no_such_scheduler_option",))
  s = _xla_options.xla_settings(schedule, None, target="h100")
  assert "xla_gpu_no_such_scheduler_option" not in s.compiler_options
  assert "xla_gpu_all_reduce_combine_threshold_bytes" in s.compiler_options
  assert any("refuses xla_gpu_no_such_scheduler_option" in n for n in s.notes)
  assert any("network=None" in n for n in s.notes) and "analytical" not in s.xla_flags


def test_no_plugin_and_no_target_gives_nothing_and_says_why(cnn_plan, monkeypatch):
  _, schedule = cnn_plan
  monkeypatch.setattr(_xla_options, "cuda_plugin_installed", lambda: False)
  with pytest.warns(UserWarning, match="CUDA plugin .* is not installed and no `target` was given"):
    assert pj.xla_options(schedule, NET) == {}
  # a plugin, but an environment that cannot build the guessed target: {} and its reason, not a raise
  monkeypatch.setattr(_xla_options, "_resolve_target", lambda target: ("h100", None))

  def unbuildable(target, options):
    raise pj.GpuCompileError("gpu_topology: JAX_PLATFORMS is not set")

  monkeypatch.setattr(_xla_options, "_accepts", unbuildable)
  with pytest.warns(UserWarning, match="no GPU target could be used .* JAX_PLATFORMS is not set"):
    assert pj.xla_options(schedule, NET) == {}
  with pytest.raises(pj.GpuCompileError, match="JAX_PLATFORMS"):   # a named target does raise
    pj.xla_options(schedule, NET, target="h100")


def test_cli_prints_the_flags_line_and_the_options(capsys):
  code = cli.main(["xla-flags", "--model", "resnet50", "--device", "h100",
                   "--workers", "8", "--network", "10gbe", "--policy", "xla", "--target", "h100"])
  out = capsys.readouterr().out.splitlines()
  assert code == 0
  assert out[0].startswith('XLA_FLAGS="--xla_gpu_all_reduce_combine_threshold_bytes=')
  assert "--xla_gpu_analytical_latency_estimator_options=nic_speed_gbps=1.25,rtt_us=25,gpus_per_node=1" in out[0]
  options = json.loads(out[1].removeprefix("compiler_options="))
  assert options["xla_gpu_enable_latency_hiding_scheduler"] is True
  assert out[2].startswith("checked against jaxlib ")


def _fsdp(width=256, layers=6):
  """A 6-layer model whose kernels are sharded over 8 devices, its params and its `fsdp` plan."""
  import numpy as np

  params = {f"l{i}": {"w": np.zeros((width, width), np.float32), "b": np.zeros((width,), np.float32)}
            for i in range(layers)}
  shardings = {f"l{i}": {"w": ("data", None), "b": None} for i in range(layers)}
  profile = pj.GradientProfile.from_params(params, forward_s=0.01, backward_s=0.02, mesh={"data": 8},
                                           shardings=shardings)
  return params, shardings, pj.plan(profile, NET, "fsdp")


def test_fsdp_plan_gets_gather_and_scatter_thresholds_that_form_its_groups(topo):
  """issue 46: an FSDP plan got an all-reduce threshold only. Now its all-gather groups' and
  reduce-scatter units' thresholds (XLA counts a collective's result: the gathered leaf, one device's
  shard); the partitioner's FSDP step compiled with them forms the plan's 6 + 6 + 1 (the biases in one chunk at
  the end: the plan is for one collective in flight, `fsdp(in_flight=1)`; alone: 1 + 1 + 1)."""
  import warnings

  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  from prophet_jax._compiled._hlo_collectives import sharded_collectives

  params, shardings, s = _fsdp()
  assert len(s.fsdp.units) == 6
  with warnings.catch_warnings():
    warnings.simplefilter("error")   # per-layer units of equal size: thresholds form them, no warning
    options = pj.xla_options(s, NET, target=topo)
  assert options["xla_gpu_all_gather_combine_threshold_bytes"] == 256 * 256 * 4        # one kernel
  assert options["xla_gpu_reduce_scatter_combine_threshold_bytes"] == 256 * 256 * 4 // 8  # its shard
  assert options["xla_gpu_all_reduce_combine_threshold_bytes"] == 6 * 256 * 4          # every bias
  assert "xla_gpu_experimental_collective_start_as_early_as_possible" not in options   # gathers stay apart

  mesh = topo.mesh("data")

  def loss(p, x):
    for i in range(6):
      x = jnp.tanh(x @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
    return jnp.mean(x ** 2)

  specs = jax.tree.map(lambda t: P(*t) if t else P(), shardings, is_leaf=lambda t: t is None or isinstance(t, tuple))
  step = jax.jit(lambda p, x: jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.grad(loss)(p, x)),
                 out_shardings=jax.tree.map(lambda sp: NamedSharding(mesh, sp), specs))
  lowered = step.lower(topo.abstract(params, specs), topo.abstract(jax.ShapeDtypeStruct((2048, 256), jnp.float32),
                                                                   P("data")))

  def counts(opts):
    text = lowered.compile(compiler_options=opts).as_text()
    got = [c.collective for c in sharded_collectives(parse_hlo(text))]
    return got.count("all-gather"), got.count("reduce-scatter"), len(allreduces(parse_hlo(text)))

  assert counts(options) == (6, 6, 1)
  assert counts({}) == (1, 1, 1)     # XLA alone: one of each


def test_settings_that_cannot_form_the_plan_say_so(cnn_plan, capsys):
  """issue 46: for a per-layer or a sliced plan the settings came back with no word that XLA forms
  other units (docs/xla_options.md measured 27 all-reduces for priority's 176 units)."""
  import warnings

  model, bucket = cnn_plan
  profile = pj.GradientProfile.from_params(model.abstract_params(), forward_s=1e-3, backward_s=2e-3)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    pj.xla_options(bucket, NET, target="h100")            # a threshold-shaped plan: formed, no warning
  with pytest.warns(UserWarning, match=r"do not give this 'wfbp' plan: its 6 all-reduce unit\(s\) become "
                                       r"about 3 .*combiner key per unit"):
    pj.xla_options(pj.plan(profile, NET, "wfbp"), NET, target="h100")
  with pytest.warns(UserWarning, match=r"'priority' plan: it sends \d+ leaves in parts"):
    pj.xla_options(pj.plan(profile, NET, "priority", partition_bytes=4096), NET, target="h100")
  code = cli.main(["xla-flags", "--model", "resnet50", "--device", "h100", "--workers", "8", "--network",
                   "10gbe", "--policy", "priority", "--target", "h100"])
  err = capsys.readouterr().err
  assert code == 0 and "warning: these settings do not give this 'priority' plan" in err, err


def test_tag_plan_refuses_an_fsdp_plan_naming_xla_options():
  """issue 46: tag_plan/tag_layers took an FSDP plan as an all-reduce plan."""
  _, _, s = _fsdp()
  with pytest.raises(ValueError, match=r"'fsdp' plan \(family 'fsdp'\) issues parameter all-gathers.*"
                                       r"xla_options\(schedule, network\)"):
    pj.tag_plan(s)
