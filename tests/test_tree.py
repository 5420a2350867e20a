"""The tree/row contract (`_tree`) and Schedule's vectorised coverage check.

The contract is one place for paths, float leaves, layers and "does this schedule fit this tree"; the
rewrite layer and the launch agreement read trees through it, so its errors must name what differs.
"""

import dataclasses

import numpy as np
import pytest

import _brute
from prophet_jax import (Bucket, Chunk, GradientProfile, NetworkModel, Schedule, ScheduleError,
                         ScheduleMismatchError, plan)
from prophet_jax._values._tree import dtype_name, flatten_with_paths, is_float_dtype, layer_of
from prophet_jax._values._checks import match_rows, match_tree

TREE = {"params": {"Dense_0": {"kernel": np.zeros((3, 4), np.float32), "bias": np.zeros(4, np.float32)},
                   "Dense_1": {"kernel": np.zeros((4, 2), np.float32)},
                   "step": np.zeros((), np.int32)}}


def _schedule(tree=TREE, policy="wfbp"):
  return plan(GradientProfile.from_params(tree, backward_s=1e-3), NetworkModel.preset("10gbe", workers=4),
              policy)


def test_float_predicate_is_jax_inexact_without_jax():
  jnp = pytest.importorskip("jax.numpy")
  import jax

  for dt in (jnp.float32, jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2,
             jnp.float8_e4m3b11fnuz, jnp.complex64, jnp.int32, jnp.uint8, jnp.bool_, jnp.int4,
             jax.dtypes.float0):
    want = bool(jnp.issubdtype(dt, jnp.inexact)) and dt != jax.dtypes.float0
    assert is_float_dtype(dt) == want, dt
  assert dtype_name(jnp.bfloat16) == "bfloat16" and dtype_name(np.float32) == "float32"


def test_paths_and_layers():
  paths = [p for p, _ in flatten_with_paths(TREE)]
  assert paths == ["params/Dense_0/bias", "params/Dense_0/kernel", "params/Dense_1/kernel", "params/step"]
  assert layer_of("params/Dense_0/kernel") == "params/Dense_0"
  assert layer_of("params/Dense_0/kernel", 1) == "params" and layer_of("w") == "w"
  with pytest.raises(ValueError, match="non-empty key path"):
    layer_of("")
  # from_params uses the same rules: float leaves only, layers by the path
  rows = GradientProfile.from_params(TREE, backward_s=1e-3).rows
  assert [(r.path, r.layer) for r in rows] == [("params/Dense_0/bias", "params/Dense_0"),
                                                ("params/Dense_0/kernel", "params/Dense_0"),
                                                ("params/Dense_1/kernel", "params/Dense_1")]


def test_match_tree_maps_rows_by_path_and_names_what_differs():
  s = _schedule()
  lmap = match_tree(flatten_with_paths(TREE), s, where="t")
  assert [lmap.paths[i] for i in lmap.row_leaf] == [p for p, _, _ in s.rows]
  renamed = {"params": {"Dense_0": TREE["params"]["Dense_0"], "Dense_9": TREE["params"]["Dense_1"]}}
  with pytest.raises(ScheduleMismatchError, match=r"t: the schedule has a row for leaf 'params/Dense_1/kernel'"
                                                   r".*e\.g\. \['params/Dense_0/kernel', "
                                                   r"'params/Dense_9/kernel'\] end the same way; the tree has paths like"):
    match_tree(flatten_with_paths(renamed), s, where="t")
  other = {"a": np.zeros(2, np.float32)}
  with pytest.raises(ScheduleMismatchError, match=r"the tree has paths like \['a'\]"):
    match_tree(flatten_with_paths(other), s, where="t")
  wide = {"params": {**TREE["params"], "Dense_1": {"kernel": np.zeros((4, 3), np.float32)}}}
  with pytest.raises(ScheduleMismatchError, match=r"leaf 'params/Dense_1/kernel' has shape \(4, 3\), but the "
                                                   r"schedule was planned for shape \(4, 2\) float32"):
    match_tree(flatten_with_paths(wide), s, where="t")
  half = {"params": {**TREE["params"], "Dense_1": {"kernel": np.zeros((4, 2), np.float16)}}}
  with pytest.raises(ScheduleMismatchError, match="has dtype float16, but the schedule was planned for dtype"):
    match_tree(flatten_with_paths(half), s, where="t")
  extra = {"params": {**TREE["params"], "x": {"w": np.zeros(2, np.float32)}, "y": np.zeros(1, np.float32)}}
  with pytest.raises(ScheduleMismatchError, match=r"floating leaf 'params/x/w'.*does not cover \(nor 1 more\)"):
    match_tree(flatten_with_paths(extra), s, where="t")
  assert match_tree(flatten_with_paths(extra), s, skip_prefixes=("params/x", "params/y")).row_leaf
  with pytest.raises(TypeError, match="must be a prophet_jax.Schedule"):
    match_tree(flatten_with_paths(TREE), s.to_dict())
  with pytest.raises(ValueError, match="tree is empty"):
    match_tree([], s)


def test_match_tree_reads_both_spellings_of_an_nnx_variable_and_rejects_two_rows_on_one_leaf():
  jax = pytest.importorskip("jax")
  from jax.tree_util import DictKey, GetAttrKey

  w, b = np.zeros((3, 4), np.float32), np.zeros(4, np.float32)
  pure = _schedule({"l1": {"bias": b, "kernel": w}})                 # rows 'l1/bias', 'l1/kernel'
  # an nnx.State of Variables: each array under GetAttrKey('value'), 'l1/kernel/value'
  variables = [((DictKey("l1"), DictKey(k), GetAttrKey("value")), x) for k, x in (("bias", b), ("kernel", w))]
  lmap = match_tree(variables, pure, where="t")
  assert lmap.paths == ("l1/bias/value", "l1/kernel/value") and lmap.row_leaf == (0, 1)
  # planned from the Variables ('.../value'), applied to the pure arrays (keys or strings alike)
  planned = _schedule({"l1": {"bias": {"value": b}, "kernel": {"value": w}}})
  assert planned.rows[0][0] == "l1/bias/value"
  assert match_tree(flatten_with_paths({"l1": {"bias": b, "kernel": w}}), planned).row_leaf == (0, 1)
  assert match_tree(jax.tree_util.tree_flatten_with_path({"l1": {"bias": b, "kernel": w}})[0],
                    planned).row_leaf == (0, 1)
  # a dict key 'value' is not a Variable: its path does not answer to the shorter one
  with pytest.raises(ScheduleMismatchError, match=r"no leaf at that path \(the tree has paths like "
                                                   r"\['l1/bias/value', 'l1/kernel/value'\]\)"):
    match_tree(jax.tree_util.tree_flatten_with_path({"l1": {"bias": {"value": b},
                                                           "kernel": {"value": w}}})[0], pure)
  # exact paths first; two rows on one leaf are an error naming both
  both = _schedule({"a": b, "a/value": b})
  assert [r[0] for r in both.rows] == ["a", "a/value"]
  assert match_tree(flatten_with_paths({"a": b, "a/value": b}), both).row_leaf == (0, 1)
  with pytest.raises(ScheduleMismatchError, match=r"t: schedule rows \['a', 'a/value'\] all name the tree's "
                                                   r"leaf 'a'.*the tree has paths like \['a'\]"):
    match_tree(flatten_with_paths({"a": b}), both, where="t")


def test_typed_prng_keys_are_not_rows():
  jax = pytest.importorskip("jax")
  key = jax.random.key(0)
  assert not is_float_dtype(key.dtype) and dtype_name(key.dtype) == "key<fry>"
  tree = {"w": np.zeros(2, np.float32), "rng": key}
  assert [r.path for r in GradientProfile.from_params(tree).rows] == ["w"]
  assert match_tree(jax.tree_util.tree_flatten_with_path(tree)[0], _schedule({"w": tree["w"]})).row_leaf == (1,)


def test_match_rows_names_the_row_and_the_fingerprints():
  s = _schedule()
  match_rows(s, GradientProfile.from_params(TREE).tree_rows(), where="w")
  rows = list(s.rows)
  rows[1] = (rows[1][0], (3, 5), rows[1][2])
  with pytest.raises(ScheduleMismatchError, match=r"w: row 1 of the Schedule is 'params/Dense_0/kernel' "
                                                   r"\(3, 4\) float32, but the profile's is .* \(3, 5\) "
                                                   r"float32 \(tree fingerprints: the Schedule's '\w+', "):
    match_rows(s, rows, where="w")
  with pytest.raises(ScheduleMismatchError, match="planned for a tree with 3 leaves, but here has 2"):
    match_rows(s, rows[:2], where="w", theirs="here")


def _mutations(s: Schedule, rng):
  """Invalid variants of a valid schedule: a slice dropped, repeated, shifted or of another dtype."""
  chunks = [list(c.slices) for c in s.chunks]
  k = int(rng.integers(len(chunks)))
  i = int(rng.integers(len(chunks[k])))
  r, a, b = chunks[k][i]
  out = []
  if len(chunks[k]) > 1:
    out.append([c if j != k else c[:i] + c[i + 1:] for j, c in enumerate(chunks)])      # drop
  out.append(chunks + [[(r, a, b)]])                                                     # repeat
  if b - a > 1:
    out.append([c if j != k else c[:i] + [(r, a, b - 1)] + c[i + 1:] for j, c in enumerate(chunks)])
    out.append([c if j != k else c[:i] + [(r, a + 1, b)] + c[i + 1:] for j, c in enumerate(chunks)])
  out.append([c if j != k else c[:i] + [(r, a, b + 1)] + c[i + 1:] for j, c in enumerate(chunks)])
  out.append([c if j != k else c[:i] + [(len(s.rows), a, b)] + c[i + 1:] for j, c in enumerate(chunks)])
  return out


@pytest.mark.parametrize("seed", range(40))
def test_vectorised_coverage_check_accepts_exactly_the_valid_schedules(seed):
  rng = np.random.default_rng(seed)
  p = _brute.random_profile(rng, int(rng.integers(1, 12)), dtypes=("float32", "bfloat16"), zero_prob=0.2)
  if not any(r.nbytes for r in p.rows):
    return
  s = _brute.random_schedule(p, rng)
  assert dataclasses.replace(s, policy="again").buckets == s.buckets      # valid: accepted again
  for chunks in _mutations(s, rng):
    dtype = {r: p.rows[r].dtype if r < len(p.rows) else "float32" for c in chunks for r, _, _ in c}
    with pytest.raises(ScheduleError):
      Schedule(buckets=tuple(Bucket(chunks=(Chunk(slices=tuple(c), dtype=dtype[c[0][0]]),)) for c in chunks),
               rows=s.rows)
  wrong = [c for c in s.chunks]
  other = "bfloat16" if wrong[0].dtype == "float32" else "float32"
  with pytest.raises(ScheduleError, match="one dtype per chunk"):
    Schedule(buckets=(Bucket(chunks=(Chunk(slices=wrong[0].slices, dtype=other), *wrong[1:])),), rows=s.rows)
