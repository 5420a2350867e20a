"""FSDP and HSDP planning (pure): placement in the profile, the `fsdp` policy, its simulation, memory
model and bound, the two-level network."""

from __future__ import annotations

import json

import numpy as np
import pytest

import prophet_jax as pj
from prophet_jax._values._errors import ProfileError

# A profile JSON written by the code before placement existed (no shard_dim, no mesh keys).
_OLD_PROFILE = (
    '{"forward_s": 0.001, "backward_s": 0.002, "method": "estimated", "model": "", "device": "", "notes": '
    '"from_params: sizes exact; times spread over layers by bytes", "schema": 1, "rows": [{"path": "a/b", '
    '"layer": "a", "shape": [4], "dtype": "float32", "nbytes": 16, "ready_s": 0.002, "fwd_s": 0.001, '
    '"update_s": 0.0}, {"path": "a/w", "layer": "a", "shape": [8, 4], "dtype": "float32", "nbytes": 128, '
    '"ready_s": 0.002, "fwd_s": 0.0, "update_s": 0.0}]}')
_OLD_FINGERPRINT = "22c05ea6d0afcb19"
_OLD_NETWORK = ('{"alpha_s": 2e-06, "beta_s_per_byte": 6.666666666666666e-12, "workers": 8, "algorithm": '
                '"ring", "overlap": true, "links": 1, "name": "nvlink", "fit_residual_s": null, "skew": 0.0}')


def _params():
  return {"a": {"w": np.zeros((8, 4), np.float32), "b": np.zeros((4,), np.float32)},
          "c": {"w": np.zeros((4, 16), np.float32)}}


class _Mesh:
  shape = {"data": 4}


class _Named:
  """A NamedSharding look-alike: `.spec` and `.mesh.shape` (duck-typed; no jax)."""

  def __init__(self, *spec):
    self.spec, self.mesh = spec, _Mesh()


def test_old_profile_json_loads_unchanged():
  p = pj.GradientProfile.from_json(_OLD_PROFILE)
  assert p.fingerprint() == _OLD_FINGERPRINT and not p.sharded and p.mesh == ()
  assert json.loads(p.to_json()) == json.loads(_OLD_PROFILE)       # written back as it was


def test_from_params_reads_specs_and_named_shardings():
  by_spec = pj.GradientProfile.from_params(
      _params(), forward_s=1e-3, backward_s=2e-3, mesh={"data": 4},
      shardings={"a": {"w": ("data", None), "b": None}, "c": {"w": (None, "data")}})
  by_named = pj.GradientProfile.from_params(
      _params(), forward_s=1e-3, backward_s=2e-3,
      shardings={"a": {"w": _Named("data", None), "b": _Named()}, "c": {"w": _Named(None, "data")}})
  assert by_spec == by_named
  assert {r.path: r.shard_dim for r in by_spec.rows} == {"a/b": None, "a/w": 0, "c/w": 1}
  assert by_spec.mesh == (("data", 4),) and by_spec.shard_axes == ("data",) and by_spec.shard_count == 4
  back = pj.GradientProfile.from_json(by_spec.to_json())
  assert back == by_spec and back.fingerprint() == by_spec.fingerprint()
  plain = pj.GradientProfile.from_params(_params(), forward_s=1e-3, backward_s=2e-3)
  assert plain.fingerprint() != by_spec.fingerprint()               # placement is in the fingerprint
  moved = pj.GradientProfile.from_params(
      _params(), forward_s=1e-3, backward_s=2e-3, mesh={"data": 4},
      shardings={"a": {"w": (None, "data"), "b": None}, "c": {"w": (None, "data")}})
  assert moved.fingerprint() != by_spec.fingerprint()


@pytest.mark.parametrize("shardings, mesh, match", [
    ({"a": {"w": ("data", "x"), "b": None}, "c": {"w": None}}, {"data": 4, "x": 2}, "a/w.*two|a/w.*dimensions"),
    ({"a": {"w": None, "b": None}, "c": {"w": ("data",)}}, {"data": 8}, "c/w.*does not divide"),
    ({"a": {"w": ("model",), "b": None}, "c": {"w": None}}, {"data": 4}, "a/w.*'model'.*not in the mesh"),
    ({"a": {"w": ("data",), "b": None}, "c": {"w": (None, ("data", "x"))}}, {"data": 2, "x": 2}, "c/w.*same"),
    ({"a": {"w": ("data",), "b": None}, "c": {"w": None}}, None, "mesh shape is unknown"),
])
def test_bad_placement_names_the_leaf(shardings, mesh, match):
  with pytest.raises(ProfileError, match=match):
    pj.GradientProfile.from_params(_params(), shardings=shardings, mesh=mesh)
