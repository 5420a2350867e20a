"""The documented training-loop snippets (the README's plain jax.jit one and docs/usage.md's shard_map one)
run as written (a host batch included) and train correctly; docs/gpu.md's compile-only one compiles."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import prophet_jax
from _assert import assert_trees_close
from prophet_jax.models import get_model

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
USAGE = ROOT / "docs" / "usage.md"
GPU = ROOT / "docs" / "gpu.md"


def _snippet(doc: Path, section: str) -> str:
  text = doc.read_text()
  start = text.index(section)
  m = re.compile(r"```python\n(.*?)```", re.S).search(text, start)
  assert m is not None, f"no python block after {section!r} in {doc.name}"
  return m.group(1)


@pytest.mark.parametrize("doc, section", [(README, "## Start: a plain `jax.jit` step on global arrays"),
                                          (USAGE, "## Under `jax.shard_map`")],
                         ids=["README-jit", "usage-shard_map"])
@pytest.mark.golden_measured  # it plans from measure_network and profile_step: its chunks follow the timings
def test_the_training_loop_snippet_runs_and_matches_the_single_device_step(monkeypatch, doc, section):
  code = _snippet(doc, section)
  assert "jax.device_put(batch, NamedSharding(mesh, P(\"dp\")))" in code
  m = get_model("mlp")
  params = m.init(jax.random.key(0))
  batches = [jax.device_get(m.make_batch(jax.random.key(10 + i), 16)) for i in range(2)]  # on the host
  # the snippet's measure_network(8) is the real probe (about a minute); a short one here
  from prophet_jax._measure import _probe

  quick = functools.partial(_probe.measure_network, sizes=(2**10, 2**16), repeats=3, inner=1)
  monkeypatch.setattr(prophet_jax, "measure_network", lambda n, **kw: quick(n, **kw), raising=False)
  monkeypatch.setattr(prophet_jax, "profile_step", functools.partial(prophet_jax.profile_step, steps=2),
                      raising=False)
  ns = {"loss_fn": m.loss_fn, "params": params, "batch": batches[0], "batches": batches, "model": m}
  exec(compile(code, str(doc), "exec"), ns)  # noqa: S102
  got = jax.device_get(ns["state"].params)
  assert np.isfinite(float(ns["loss"]))

  tx = optax.sgd(0.05, momentum=0.9)  # the snippet's optimizer, on one device with the full batch
  p, o = params, tx.init(params)
  for b in batches:
    u, o = tx.update(jax.grad(m.loss_fn)(p, b), o, p)
    p = optax.apply_updates(p, u)
  assert_trees_close(got, jax.device_get(p), params)


@pytest.mark.gpu
def test_the_gpu_compile_snippet_defines_its_step_and_compiles_as_written(capsys):
  """issue 29: the snippet once used a `step` it never defined; written the obvious way it failed with
  jax's "could not infer replication". As written now: compiled for 8 compile-only H100s, audited OK."""
  try:
    prophet_jax.gpu_topology("h100", devices=8)
  except prophet_jax.GpuCompileError as e:
    pytest.fail(f"{e}\nThe test extra includes gpu-compile: pip install -e '.[gpu-compile]'.", pytrace=False)
  code = _snippet(GPU, "## Compile for a GPU on a machine without one")
  assert "def step(" in code and "pip install -e '.[gpu-compile]'" in GPU.read_text()
  m = get_model("mlp")
  params = m.abstract_params()
  batch = jax.eval_shape(lambda: m.make_batch(jax.random.key(0), 16))
  profile = prophet_jax.GradientProfile.from_params(params, forward_s=1e-3, backward_s=2e-3)
  network = prophet_jax.NetworkModel.preset("10gbe", workers=8)
  schedule = prophet_jax.plan(profile, network, "wfbp")
  ns = {"loss_fn": m.loss_fn, "params": params, "batch": batch, "schedule": schedule, "network": network}
  exec(compile(code, str(GPU), "exec"), ns)  # noqa: S102
  assert ns["report"].ok and len(ns["report"].chunks) == schedule.num_allreduces
  assert prophet_jax.audit(ns["compiled"], ns["cnn_schedule"]).ok
  assert "OK" in capsys.readouterr().out
  # issue 35: the dear variant, as docs/gpu.md writes it, in the same names
  exec(compile(_snippet(GPU, "### A sharded (`dear`) schedule's step"), str(GPU), "exec"), ns)  # noqa: S102
  report = prophet_jax.audit(ns["compiled"], ns["dear"])
  assert report.ok and ns["dear"].sharded, report.describe()
  # issue 46: the deferring dlcp variant (its prose recipe, `state_specs` for the second P(), failed:
  # shard_map could not split one device's state), on a network where the plan defers
  ns["network"] = prophet_jax.NetworkModel(workers=8, alpha_s=1e-6, beta_s_per_byte=1e-7)
  exec(compile(_snippet(GPU, "### A deferring (`dlcp`) schedule's step"), str(GPU), "exec"), ns)  # noqa: S102
  report = prophet_jax.audit(ns["compiled"], ns["dlcp"])
  assert ns["dlcp"].defers and report.ok, report.describe()
