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
