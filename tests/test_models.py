"""Tests of prophet_jax.models: the trainable registry, the reference architectures and the traces."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from prophet_jax.models import MODELS, forward_paths, get_model, layer_of, num_params

# -------------------------------------------------------------------------------------------------
# registry


@pytest.mark.parametrize("name", MODELS)
def test_registry_shapes_sizes_and_dtypes(name):
  for dtype in ("float32", "bfloat16"):
    m = get_model(name, param_dtype=dtype)
    params = m.abstract_params()
    assert list(params) == ["params"]
    leaves = jax.tree_util.tree_leaves(params)
    assert all(str(x.dtype) == dtype for x in leaves), (name, dtype)
    assert 10_000 <= num_params(params) <= 200_000, (name, num_params(params))
    batch = jax.eval_shape(lambda k: m.make_batch(k, 8), jax.random.key(0))
    assert set(batch) == {"x", "y"} and all(v.shape[0] == 8 for v in batch.values())
    loss = jax.eval_shape(m.loss_fn, params, batch)
    assert loss.shape == () and loss.dtype == jnp.float32
  assert m.default_batch_size % 8 == 0


def test_make_batch_is_deterministic_and_checks_size():
  m = get_model("gpt-tiny")
  a, b = m.make_batch(jax.random.key(3), 8), m.make_batch(jax.random.key(3), 8)
  c = m.make_batch(jax.random.key(4), 8)
  assert all(np.array_equal(a[k], b[k]) for k in a)
  assert not np.array_equal(a["x"], c["x"])
  # the targets are the inputs shifted by one token
  assert np.array_equal(a["x"][:, 1:], a["y"][:, :-1])
  with pytest.raises(ValueError, match="batch_size=0"):
    m.make_batch(jax.random.key(0), 0)
  # inside a trace (jit) the same values; on another device too
  mlp, key = get_model("mlp"), jax.random.key(5)
  ref = mlp.make_batch(key, 8)
  traced = jax.jit(lambda k: mlp.make_batch(k, 8))(key)
  assert np.array_equal(ref["y"], traced["y"]) and np.allclose(ref["x"], traced["x"], atol=1e-6)
  other = mlp.make_batch(jax.device_put(key, jax.devices()[-1]), 8)
  assert np.array_equal(ref["y"], other["y"]) and np.allclose(ref["x"], other["x"], atol=1e-6)


def test_unknown_model_and_dtype():
  with pytest.raises(ValueError, match="unknown model.*'mlp'"):
    get_model("mlpp")
  with pytest.raises(ValueError, match="param_dtype='float16'.*bfloat16"):
    get_model("mlp", param_dtype="float16")


@pytest.mark.parametrize("name", ["mlp", "gpt-tiny"])
def test_loss_falls_and_is_a_batch_mean(name):
  m = get_model(name)
  params = m.init(jax.random.key(0))
  tx = optax.sgd(0.05 if name == "mlp" else 0.3, momentum=0.9)

  @jax.jit
  def step(p, s, b):
    loss, g = jax.value_and_grad(m.loss_fn)(p, b)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  batch = m.make_batch(jax.random.key(1))

  @jax.jit
  def three_losses(p, b):  # one program: the full batch and its two halves
    return [m.loss_fn(p, {k: v[s] for k, v in b.items()})
            for s in (slice(None), slice(None, 16), slice(16, None))]

  if name == "mlp":  # (one compile less for gpt-tiny, whose loss is the same jnp.mean)
    full, a, b = (float(x) for x in three_losses(params, batch))
    assert abs(full - (a + b) / 2) < 1e-5 * abs(full)  # a mean over the batch, not a sum
  state, losses = tx.init(params), []
  for i in range(20):
    params, state, loss = step(params, state, m.make_batch(jax.random.key(i)))
    losses.append(float(loss))
  assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:3]), losses


def test_forward_paths_follow_the_forward_pass_not_sorted_keys():
  m = get_model("mlp")
  order = m.forward_paths()
  flat = [jax.tree_util.keystr(p, simple=True, separator="/")
          for p, _ in jax.tree_util.tree_flatten_with_path(m.abstract_params())[0]]
  assert sorted(order) == sorted(flat)
  layers = list(dict.fromkeys(layer_of(p) for p in order))
  assert layers == [f"params/Dense_{i}" for i in range(12)]
  assert flat.index("params/Dense_10/kernel") < flat.index("params/Dense_2/kernel")  # the trap
  # the tied embedding of gpt-tiny is read first in the forward pass (the lookup)
  assert get_model("gpt-tiny").forward_paths()[:2] == ("params/wte/embedding", "params/wpe/embedding")
  # a hand-made function: b is read before a
  order = forward_paths(lambda p, x: jnp.sum(p["b"] * x) + jnp.sum(p["a"]),
                        {"a": jnp.ones(2), "b": jnp.ones(2)}, jnp.ones(2))
  assert order == ("b", "a")

  # an identity hook and casts applied to every leaf up front are not uses; jit and scan bodies are
  # searched; an unread leaf comes last
  @jax.custom_vjp
  def hook(t):
    return t

  hook.defvjp(lambda t: (t, None), lambda _, g: (g,))

  def f(p, x):
    a, b, c = hook((p["a"], p["b"], p["c"]))
    a = a.astype(jnp.bfloat16).reshape(2)
    h = jax.nn.relu(c * x)
    h = jax.jit(lambda h, b: h * b)(h, b)
    return jax.lax.scan(lambda h, _: (h * a, None), h, None, length=2)[0].sum()

  p = {"a": jnp.ones(2), "b": jnp.ones(2), "c": jnp.ones(2), "unused": jnp.ones(1)}
  assert forward_paths(f, p, jnp.ones(2)) == ("c", "b", "a", "unused")


def test_layer_of():
  assert layer_of("params/Conv_0/kernel") == "params/Conv_0"
  assert layer_of("wpe") == "wpe"
  with pytest.raises(ValueError, match="path=''"):
    layer_of("")


# -------------------------------------------------------------------------------------------------
# reference architectures and the bundled traces

from prophet_jax import NetworkModel, TraceUnavailableError  # noqa: E402
from prophet_jax.models import (ALGORITHM_SWITCH_BYTES, ARCHITECTURES, TRACES, architecture,  # noqa: E402
                                googlenet_allreduce, googlenet_available, googlenet_comm_s, load_trace,
                                reference_param_count)

GOOGLENET_OK, GOOGLENET_WHY = googlenet_available()
needs_googlenet = pytest.mark.skipif(not GOOGLENET_OK, reason=GOOGLENET_WHY)
BUNDLED = [t for t in TRACES if t != "googlenet-k80"]
# the decoder-only traces (FSDP planning; h100 only, bfloat16 rows): published parameter counts
DECODER_PARAMS = {"llama-1b": 1_235_814_400, "llama-8b": 8_030_261_248}


def test_architecture_param_counts_match_the_published_models():
  counts = {name: num_params(architecture(name).abstract_params()) for name in ARCHITECTURES}
  assert counts == {"resnet50": 25_557_032, "vgg16": 138_357_544, "bert-base": 109_482_240,
                    "gpt2": 124_439_808}
  assert all(counts[n] == reference_param_count(n) for n in ARCHITECTURES)
  with pytest.raises(ValueError, match="unknown architecture.*'gpt2'"):
    architecture("gpt3")


def _tree_from_rows(rows):
  tree = {}
  for r in rows:
    *parents, leaf = r.path.split("/")
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = jax.ShapeDtypeStruct(r.shape, jnp.float32)
  return tree


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_trace_rows_are_the_flax_leaves_in_forward_order(name):
  """The bundled rows (paths, shapes, order) are exactly the flax model's leaves in forward order."""
  arch, prof = architecture(name), load_trace(f"{name}-v100")
  params = _tree_from_rows(prof.rows)  # flax checks every shape against its definition
  state = {}
  if name == "resnet50":  # BatchNorm's running statistics: same shapes as its scale
    scales = [r for r in prof.rows if r.path.endswith("/scale")]
    assert len(scales) == 53
    state = {"batch_stats": {}}
    for r in scales:
      node = state["batch_stats"]
      for p in r.layer.split("/")[1:]:
        node = node.setdefault(p, {})
      stat = jax.ShapeDtypeStruct(r.shape, jnp.float32)
      node.update(mean=stat, var=stat)
  order = arch.forward_paths(params, state)
  assert list(order) == [r.path for r in prof.rows]
  assert sum(r.size for r in prof.rows) == reference_param_count(name)


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_traces(name):
  prof = load_trace(name)
  model, device = name.rsplit("-", 1)
  assert (prof.model, prof.device, prof.method) == (model, device, "estimated")
  dtype, isz = ("bfloat16", 2) if model in DECODER_PARAMS else ("float32", 4)
  assert all(r.dtype == dtype and r.nbytes == isz * r.size for r in prof.rows)
  assert sum(r.size for r in prof.rows) == (DECODER_PARAMS.get(model) or reference_param_count(model))
  assert 1.9 <= prof.backward_s / prof.forward_s <= 2.1
  assert prof.update_s > 0 and all(r.update_s > 0 for r in prof.rows)
  # backward runs from the last layer to the first: ready times never increase along the rows
  ready = [r.ready_s for r in prof.rows]
  assert all(a >= b for a, b in zip(ready, ready[1:]))
  assert ready[0] == pytest.approx(prof.backward_s) and ready[-1] < prof.backward_s / 2
  assert dtype in prof.notes and ("v100" in name) == ("15.7 TFLOP/s" in prof.notes)
  first = {"resnet50": "params/conv1/kernel", "vgg16": "params/conv1_1/kernel",
           "bert-base": "params/embeddings/word_embeddings/embedding", "gpt2": "params/wte/embedding",
           "llama-1b": "params/embed/embedding", "llama-8b": "params/embed/embedding"}
  assert prof.rows[0].path == first[model]


def test_bundled_trace_details():
  gpt = load_trace("gpt2-h100")
  # tied embedding: needed first by the forward pass (row 0), complete only at the end of backward
  assert gpt.rows[0].path == "params/wte/embedding" and gpt.rows[0].ready_s == gpt.backward_s
  assert gpt.rows[0].shape == (50257, 768) and gpt.rows[-1].layer == "params/ln_f"
  assert "tied" in gpt.notes.lower()
  assert "NOT included" in load_trace("bert-base-v100").notes  # the MLM head
  for model in ("resnet50", "vgg16", "bert-base", "gpt2"):  # the faster device is faster
    v, h = load_trace(f"{model}-v100"), load_trace(f"{model}-h100")
    assert h.compute_s < v.compute_s / 5
    assert v.tree_rows() == h.tree_rows()
  # ResNet-50 (fp32, V100, 64 images): the estimate is in the range of published throughput
  r = load_trace("resnet50-v100")
  assert 250 <= 64 / (r.forward_s + r.backward_s) <= 450
  with pytest.raises(ValueError, match="unknown trace.*'resnet50-v100'"):
    load_trace("resnet51-v100")
  with pytest.raises(ValueError, match="only to 'googlenet-k80'"):
    load_trace("resnet50-v100", nodes=4)


def _same_up_to_rounding(a, b, where: str = "profile") -> None:
  """`a == b` field by field, except that floats agree to 1e-9 relative: the traces are sums of FLOP
  estimates, and numpy releases round them differently in the last bits (numpy 2.5 against the numpy
  that wrote the files)."""
  import dataclasses
  import math

  if dataclasses.is_dataclass(a):
    assert type(a) is type(b), where
    for f in dataclasses.fields(a):
      _same_up_to_rounding(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
  elif isinstance(a, (tuple, list)):
    assert type(a) is type(b) and len(a) == len(b), where
    for k, (x, y) in enumerate(zip(a, b)):
      _same_up_to_rounding(x, y, f"{where}[{k}]")
  elif isinstance(a, float) and not isinstance(b, bool):
    assert isinstance(b, float) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-18), (where, a, b)
  else:
    assert a == b, (where, a, b)


def test_bundled_traces_are_up_to_date():
  from prophet_jax.models import make_traces

  for name in ("gpt2-v100", "resnet50-h100", "llama-8b-h100"):
    model, device = name.rsplit("-", 1)
    _same_up_to_rounding(make_traces.build_profile(model, device), load_trace(name), name)
  # the comparison fails for a real change: one row's time moved by one part in a million
  built = make_traces.build_profile("gpt2", "v100")
  row = built.rows[3]
  moved = dataclasses.replace(built, rows=built.rows[:3] + (dataclasses.replace(
      row, ready_s=row.ready_s * (1 + 1e-6)),) + built.rows[4:])
  with pytest.raises(AssertionError, match="rows.3..ready_s"):
    _same_up_to_rounding(moved, load_trace("gpt2-v100"), "gpt2-v100")


def test_every_models_name_resolves():
  import prophet_jax.models as pm

  for name in pm.__all__:
    assert getattr(pm, name) is not None
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    pm.nope  # noqa: B018


def test_load_trace_needs_no_jax():
  import subprocess
  import sys

  code = ("import sys; sys.modules['jax'] = None\n"
          "from prophet_jax.models import load_trace, TRACES\n"
          "print(len(load_trace('vgg16-h100').rows))\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert out.returncode == 0 and out.stdout.strip() == "32", out.stderr


# -------------------------------------------------------------------------------------------------
# GoogLeNet / K80 (the public data set in ../shared/traces, read at run time)


def test_googlenet_absent_is_reported_clearly(tmp_path):
  with pytest.raises(TraceUnavailableError, match=f"not on this machine.*{tmp_path}"):
    load_trace("googlenet-k80", shared_dir=tmp_path)
  with pytest.raises(TraceUnavailableError, match="shared_dir="):
    googlenet_allreduce(8, shared_dir=tmp_path)
  with pytest.raises(ValueError, match=r"nodes=3.*\[2, 4, 8\]"):
    load_trace("googlenet-k80", nodes=3)


@needs_googlenet
def test_googlenet_trace():
  import re

  prof = load_trace("googlenet-k80")
  assert prof is not None and len(prof.rows) == 128 and len(prof.layers) == 64
  assert prof.rows[0].path == "params/conv1/7x7_s2/weight" and prof.rows[0].shape == (9408,)
  assert prof.rows[-1].path == "params/loss3/classifier/bias" and prof.rows[-1].shape == (1000,)
  assert sum(r.size for r in prof.rows) == 13_378_280
  # an independent read of the last pass: one time per layer (weight and bias rows repeat it)
  text = (GOOGLENET_DIR / "tmp8comm.log").read_text()
  rows = [[float(v) for v in m.split(",")] for m in re.findall(r"\] \[([^\]]+)\]", text)][-128:]
  per_layer_s = [rows[i][2] * 1e-6 for i in range(0, 128, 2)]
  assert prof.backward_s == pytest.approx(sum(per_layer_s))
  assert prof.forward_s == pytest.approx(0.5 * sum(per_layer_s))
  assert prof.rows[0].ready_s == pytest.approx(prof.backward_s)
  assert prof.rows[-1].ready_s == pytest.approx(per_layer_s[-1])
  assert prof.rows[1].ready_s == prof.rows[0].ready_s and prof.rows[1].fwd_s == 0
  for nodes in (2, 4):
    other = load_trace("googlenet-k80", nodes=nodes)
    assert other.tree_rows() == prof.tree_rows() and other.backward_s != prof.backward_s
  comm = googlenet_comm_s(8)
  assert comm.shape == (128,) and comm[0] == pytest.approx(rows[0][3] * 1e-6)
  assert np.all(comm[0::2] > 0) and np.sum(comm[1::2] == 0) >= 60  # bias folded into the weight row


GOOGLENET_DIR = __import__("pathlib").Path(GOOGLENET_WHY) if GOOGLENET_OK else None


@needs_googlenet
def test_googlenet_allreduce_and_fit():
  for nodes in (2, 4, 8):  # allreduce4.log has no 'nodes,' prefix: it must parse all the same
    sizes, secs = googlenet_allreduce(nodes)
    assert len(sizes) == 266 and sizes[0] == 4 and sizes[-1] == 1048576
    assert np.all(np.diff(sizes) > 0) and np.all(secs > 0)
  for nodes in (2, 4, 8):
    sizes, secs = googlenet_allreduce(nodes, min_bytes=ALGORITHM_SWITCH_BYTES)
    assert sizes.min() == 12288
    big = NetworkModel.fit(sizes, secs, workers=nodes)
    every = NetworkModel.fit(*googlenet_allreduce(nodes), workers=nodes)

    def rel_err(m):
      return np.abs(np.array([m.allreduce_s(x) for x in sizes]) / secs - 1)

    # the large-size regime is a line; letting the small-size regime in distorts the fit
    assert np.median(rel_err(big)) < 0.06 and np.max(rel_err(big)) < 0.25
    assert np.max(rel_err(every)) > 2 * np.max(rel_err(big))
