"""The library across two real processes: ONE launch (2 processes x 4 host devices, gloo bound to the
loopback interface) runs every cross-process check in tests/_two_process_checks.py, and each test here
asserts one check by name.

The oracles: the single-device full-batch loop (tests/_example_ref.py), the one-process run of the same
example, the plain jit step, each with a control that fails (a mean over n - 1, a 1% larger update); the
ranks' own outputs where the claim is agreement (the same deferred chunks, the same schedule).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from _example_ref import example_env, full_batch_mlp, load_npz

from tests._assert import assert_trees_close

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
N = 8  # devices over both processes
pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
  """(outputs by check name: {rank: result}, the launch's output directory, its stdout)."""
  out = tmp_path_factory.mktemp("two")
  r = subprocess.run([PY, "-m", "prophet_jax.launch", "--nproc", "2", "--gloo-interface", "lo",
                      "--init-timeout", "60", "--", PY, str(ROOT / "tests" / "_two_process_checks.py"),
                      str(out)], env=example_env(), capture_output=True, text=True, timeout=400)
  found: dict = {}
  for line in r.stdout.splitlines():
    m = re.match(r"\[rank (\d)\] CHECK (\w+) (.*)$", line)
    if m:
      found.setdefault(m.group(2), {})[int(m.group(1))] = json.loads(m.group(3))
  return found, out, r


def check(launched, name: str) -> dict:
  """{rank: result} of one check; fails with the check's error, or the launch's output if it never ran."""
  found, _, r = launched
  got = found.get(name, {})
  errors = [f"rank {k}: {v['error']}" for k, v in got.items() if "error" in v]
  assert not errors, "\n".join(errors)
  assert sorted(got) == [0, 1], (f"check {name!r} did not report on both ranks (launch rc {r.returncode}):\n"
                                 + r.stdout[-3000:] + r.stderr[-3000:])
  return got


def test_psum_with_gloo_bound_to_loopback(launched):
  """The private gloo binding works end to end (on 'lo'; the shaped-link bench binds a veth)."""
  for rank, got in check(launched, "psum").items():
    assert got == {"psum": 4 * 1.0 + 4 * 2.0, "processes": 2, "local_devices": 4}, (rank, got)


def test_broadcast_failures_give_a_clear_error_on_every_rank(launched):
  """A rank whose tree differs, and rank 0 failing before the broadcast: every rank says why, at once
  (no rank waits in a collective for a schedule that never comes), and the ranks stay in step."""
  got = check(launched, "broadcast")
  r0, r1 = got[0], got[1]
  assert "ERR ScheduleMismatchError: rank 1: broadcast_schedule: leaf 'a/kernel'" in r1["tree"]
  assert "(3, 5)" in r1["tree"]
  assert "ERR LaunchError: rank 0: rank(s) [1] found that rank 0's schedule" in r0["tree"]
  assert "rank 1: broadcast_schedule: leaf 'a/kernel'" in r0["tree"]  # rank 0 quotes rank 1's reason
  assert "ERR ValueError: no policy 'fastest'" in r0["raised"]
  assert ("ERR LaunchError: rank 1: rank 0 sent no schedule; it failed before broadcasting it with "
          "ValueError: no policy 'fastest'") in r1["raised"]
  assert "ERR ValueError: broadcast_schedule: expected a Schedule on rank 0" in r0["none"]
  assert "ERR LaunchError: rank 1: rank 0 sent no schedule" in r1["none"]
  assert r0["ok"] == r1["ok"] == "OK 2"


def _trained(launched, name: str, npz: str) -> tuple[str, dict]:
  got = check(launched, name)
  assert got[0]["code"] == got[1]["code"] == 0
  return got[0]["stdout"], load_npz(launched[1] / npz)


def _against(got: dict, ref: dict, before: dict, *, scale: float) -> None:
  """`got` equals `ref` (docs/design.md's tolerance) and the update scaled by `scale` does not."""
  assert sorted(got) == sorted(ref) == sorted(before)
  assert all(np.max(np.abs(ref[k] - before[k])) > 0 for k in ref), "training did not move every leaf"
  assert_trees_close(got, ref, before)
  with pytest.raises(AssertionError):
    assert_trees_close({k: before[k] + scale * (got[k] - before[k]) for k in got}, ref, before)


def test_a_multi_chunk_schedule_matches_the_single_device_full_batch_and_one_process(launched, tmp_path):
  """examples/train_flax.py under launch, a 12-chunk wfbp schedule, against the single-device
  full-batch loop computed here (not the library compared with itself; a mean over n - 1 fails), and
  against the example run as one process of 8 devices (a 1% larger update, or a lost slice, fails)."""
  stdout, got = _trained(launched, "flax_wfbp", "flax-wfbp.npz")
  assert "on 2 process(es) x 4 device(s)" in stdout, stdout
  chunks = int(re.search(r"schedule wfbp .*?(\d+) all-reduces", stdout).group(1))
  assert chunks > 1, "a one-chunk schedule proves nothing about order or slicing"
  before, ref = full_batch_mlp(3)  # the example's defaults: lr 0.05, seed 0, the model's batch
  _against(got, ref, before, scale=N / (N - 1))

  one = tmp_path / "one.npz"
  r = subprocess.run([PY, str(ROOT / "examples" / "train_flax.py"), "--model", "mlp", "--steps", "3",
                      "--policy", "wfbp", "--out", str(one)], env=example_env(), capture_output=True,
                     text=True, timeout=240)
  assert r.returncode == 0, r.stdout + r.stderr
  assert "1 process(es) x 8 device(s)" in r.stdout
  single = load_npz(one)
  _against(got, single, before, scale=1.01)
  k0 = sorted(got)[0]
  lost = dict(got, **{k0: np.where(np.arange(got[k0].size).reshape(got[k0].shape) == 0, before[k0], got[k0])})
  with pytest.raises(AssertionError, match=re.escape(k0)):
    assert_trees_close(lost, single, before)


def test_a_dear_schedule_matches_the_single_device_full_batch(launched):
  """examples/train_jit.py --policy dear: the plain jit step with hooked(mesh=) gradient shards and
  scheduled(mesh=)'s ZeRO-1 update, against the single-device full-batch loop; a mean over n - 1 fails."""
  stdout, got = _trained(launched, "jit_dear", "jit-dear.npz")
  assert "2 process(es) x 4 device(s), hooked, policy dear" in stdout, stdout
  found = re.search(r"sharded \(ZeRO-1\): (\d+) reduce-scatters in backward, (\d+) all-gathers", stdout)
  assert found and int(found.group(1)) > 1 and int(found.group(2)) >= 1, stdout  # the plain step: 1 gather
  before, ref = full_batch_mlp(3)
  _against(got, ref, before, scale=N / (N - 1))


def test_the_fsdp_example_matches_the_single_device_full_batch(launched):
  """examples/train_fsdp.py under launch: hooked with an FSDP plan on the mesh of both processes (each weight
  sharded over the 8 devices of 2 processes), its compiled step audited, its gradients equal to the
  partitioner's at the first step, and after 3 SGD steps the params (gathered from both processes) equal to
  the single-device full-batch loop computed here; a mean over n - 1 fails."""
  import jax
  import optax

  from _reference import full_batch
  from examples import train_fsdp
  from prophet_jax._values._tree import flatten_with_paths

  stdout, got = _trained(launched, "fsdp", "fsdp.npz")
  assert "3 steps on 2 process(es) x 4 device(s)" in stdout and "audit OK" in stdout, stdout
  assert "(equal)" in stdout, stdout
  args = train_fsdp.parse_args(["--steps", "3", "--opt", "sgd"])
  module, loss_fn = train_fsdp.make_model(args.layers, args.d, args.vocab)
  params = module.init(jax.random.key(0), train_fsdp.batch_at(0, args)["tokens"][:1])
  final, _ = full_batch(loss_fn, params, optax.sgd(0.1, momentum=0.9), [train_fsdp.batch_at(k, args) for k in range(3)])
  as_dict = lambda t: {k: np.asarray(v) for k, v in flatten_with_paths(t)}  # noqa: E731
  _against(got, as_dict(final), as_dict(params), scale=N / (N - 1))


def test_the_jit_example_on_one_and_two_processes_matches_the_plain_jit_step(launched, tmp_path):
  """examples/train_jit.py (mgwfbp) under launch (hooked) and on one process (pipelined) ends where the
  plain jit step (the partitioner's own gradient all-reduce) ends; a 1% larger update fails."""
  stdout, two = _trained(launched, "jit_mgwfbp", "jit-mgwfbp.npz")
  assert "2 process(es) x 4 device(s), hooked" in stdout, stdout
  one = tmp_path / "one.npz"
  r = subprocess.run([PY, str(ROOT / "examples" / "train_jit.py"), "--model", "mlp", "--steps", "3",
                      "--policy", "mgwfbp", "--lr", "0.05", "--mode", "pipelined", "--out", str(one)],
                     env=example_env(), capture_output=True, text=True, timeout=240)
  assert r.returncode == 0, r.stdout + r.stderr
  assert "1 process(es) x 8 device(s), pipelined" in r.stdout
  before, ref = _plain_jit_reference()
  _against(load_npz(one), ref, before, scale=1.01)
  _against(two, ref, before, scale=1.01)


def _plain_jit_reference(steps: int = 3, lr: float = 0.05):
  """train_jit.py's loop with jax.value_and_grad in place of hooked: (initial, final) params by path."""
  import jax
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from prophet_jax._values._tree import flatten_with_paths
  from prophet_jax.models import get_model

  model = get_model("mlp")
  mesh = jax.make_mesh((N,), ("dp",))
  params = jax.device_put(model.init(jax.random.key(0)), NamedSharding(mesh, P()))
  tx = optax.sgd(lr, momentum=0.9)
  opt = jax.device_put(tx.init(params), NamedSharding(mesh, P()))

  @jax.jit
  def step(p, o, b):
    u, o = tx.update(jax.grad(model.loss_fn)(p, b), o, p)
    return optax.apply_updates(p, u), o

  before = {k: np.asarray(x) for k, x in flatten_with_paths(params)}
  for k in range(steps):
    b = model.make_batch(jax.random.key(10_000 + k), model.default_batch_size)
    params, opt = step(params, opt, jax.device_put(b, NamedSharding(mesh, P("dp"))))
  return before, {k: np.asarray(x) for k, x in flatten_with_paths(params)}


def test_every_device_of_both_processes_defers_the_same_chunks(launched):
  """Float gradients of random scale: every device of both processes ranks by the same norms (bitwise)
  and defers the same chunks at every step."""
  seen: dict = {}
  for rank, got in check(launched, "defer").items():
    for t, g, dev, chosen, norms in got["rows"]:
      seen.setdefault((t, g), set()).add((rank, dev, str(chosen), norms))
  assert len(seen) == 6 * 2, seen.keys()
  choices = set()
  for (t, g), rows in seen.items():
    assert len(rows) == N and {rk for rk, *_ in rows} == {0, 1}, rows  # 2 ranks x 4 devices
    # the same chosen chunks, and the same norms bit for bit, on all 8 devices of both processes
    assert len({(c, nb) for _, _, c, nb in rows}) == 1, f"step {t} group {g}: {rows}"
    choices.add((g, next(iter(rows))[2]))
  assert len(choices) > 4, "the ranking never changed: nothing was tested"


def test_the_monitor_keeps_both_processes_on_rank_0s_schedule(launched):
  got = check(launched, "monitor")
  a, b = got[0], got[1]
  assert a["own"] != b["own"]  # alone, the ranks would plan differently
  assert a["schedule"] == b["schedule"]  # with the Monitor, rank 0 decides for both
  assert a["schedule"] == a["own"]  # and rank 0 saw the slow link: it switched
  assert a["probe"] == b["probe"] and a["workers"] == N  # the probe spans both processes' devices


def test_choose_takes_one_decision_from_the_slowest_process(launched):
  from prophet_jax import Choice

  got = check(launched, "choose")
  a, b = (Choice.from_json(got[r]["choice"]) for r in (0, 1))
  assert a == b and a.processes == 2 and got[0]["fp"] == got[1]["fp"]
  # rank 0 alone would pick the candidate; its time is rank 1's (slower), so the control stays
  assert a.best == "control" and a.verdicts["cand"] == "slower" and a.median_s["cand"] > 0.008, a.describe()
  assert a.compared["cand"].startswith("equal")   # what it computes, compared the same on both processes
