"""launch / initialize / _config / gloo binding: the launcher's contract, cheaply (plain shell commands) and
with real jax.distributed processes (marked multiprocess)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time

import pytest

from prophet_jax._values import _config
from prophet_jax._multiprocess._launcher import _device_flags, _split_coordinator, free_port
from prophet_jax.launch import launch

PY = sys.executable


def _run_launch(cmd, **kw):
  out, err = io.StringIO(), io.StringIO()
  t0 = time.monotonic()
  code = launch(cmd, stdout=out, stderr=err, **kw)
  return code, out.getvalue(), err.getvalue(), time.monotonic() - t0


# -- _config ---------------------------------------------------------------------------------------


def test_config_reads_process_flags():
  cfg = _config.read_config({"PROPHET_PROCESS_ID": "1", "PROPHET_NUM_PROCESSES": "2",
                             "PROPHET_COORDINATOR": "127.0.0.1:1234", "PROPHET_GLOO_INTERFACE": "veth0",
                             "PROPHET_INIT_TIMEOUT_S": "7", "PROPHET_DEBUG": "yes", "HOME": "/x"})
  assert (cfg.process_id, cfg.num_processes, cfg.coordinator) == (1, 2, "127.0.0.1:1234")
  assert cfg.gloo_interface == "veth0" and cfg.init_timeout_s == 7 and cfg.debug and cfg.launched
  empty = _config.read_config({})
  assert not empty.launched and empty.init_timeout_s == _config.DEFAULT_INIT_TIMEOUT_S


@pytest.mark.parametrize("env, match", [
    ({"PROPHET_PROCES_ID": "1"}, "unknown environment variable.*PROPHET_PROCES_ID"),
    ({"PROPHET_PROCESS_ID": "1"}, "come together"),
    ({"PROPHET_PROCESS_ID": "2", "PROPHET_NUM_PROCESSES": "2", "PROPHET_COORDINATOR": "h:1"},
     "PROPHET_PROCESS_ID=2.*\\[0, 1\\]"),
    ({"PROPHET_PROCESS_ID": "x", "PROPHET_NUM_PROCESSES": "2", "PROPHET_COORDINATOR": "h:1"},
     "PROPHET_PROCESS_ID='x' is not an integer"),
    ({"PROPHET_PROCESS_ID": "0", "PROPHET_NUM_PROCESSES": "2", "PROPHET_COORDINATOR": "nohost"},
     "PROPHET_COORDINATOR='nohost' is not 'host:port'"),
    ({"PROPHET_INIT_TIMEOUT_S": "0"}, "PROPHET_INIT_TIMEOUT_S='0' is below 1"),
    ({"PROPHET_DEBUG": "maybe"}, "PROPHET_DEBUG='maybe'"),
    ({"PROPHET_GLOO_INTERFACE": "a b"}, "PROPHET_GLOO_INTERFACE='a b'"),
])
def test_config_rejects_bad_values(env, match):
  with pytest.raises(ValueError, match=match):
    _config.read_config(env)


def test_config_is_pure():
  code = ("import sys; sys.modules['jax'] = None; from prophet_jax._values import _config; "
          "print(_config.read_config({}).launched)")
  r = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
  assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


# -- helpers ---------------------------------------------------------------------------------------


def test_device_flags_split_the_parent_count():
  flags, n = _device_flags("--foo --xla_force_host_platform_device_count=8", 2, None)
  assert n == 4 and flags == "--foo --xla_force_host_platform_device_count=4"
  assert _device_flags("--foo", 2, None) == ("--foo", None)
  assert _device_flags("", 3, 2) == ("--xla_force_host_platform_device_count=2", 2)
  with pytest.raises(ValueError, match="do not split evenly over nproc=3"):
    _device_flags("--xla_force_host_platform_device_count=8", 3, None)


def test_coordinator_parsing():
  assert _split_coordinator(None, None) == ("127.0.0.1", None)
  assert _split_coordinator("10.0.0.1:99", None) == ("10.0.0.1", 99)
  assert _split_coordinator("10.0.0.1", 5) == ("10.0.0.1", 5)
  with pytest.raises(ValueError, match="names port 99 but port=5"):
    _split_coordinator("10.0.0.1:99", 5)


@pytest.mark.parametrize("kw, match", [
    (dict(nproc=0), "`nproc` must be an integer >= 1"),
    (dict(nproc=2, port=70000), "port=70000"),
    (dict(nproc=2, devices_per_process=0), "devices_per_process=0"),
    (dict(nproc=2, gloo_interface="nosuchif0"), "gloo_interface='nosuchif0' is not a network interface"),
])
def test_launch_rejects_bad_arguments(kw, match):
  with pytest.raises(ValueError, match=match):
    launch([PY, "-c", "pass"], **kw)
  with pytest.raises(ValueError, match="command is empty"):
    launch([], nproc=1)


def test_one_parser_for_the_cli_and_python_m(monkeypatch):
  """`prophet-jax launch` and `python -m prophet_jax.launch` parse the same arguments (the error for an
  uneven device split names --devices-per-process, so the CLI must take it) and hand them to launch."""
  from prophet_jax._multiprocess import _launcher
  from prophet_jax import cli

  seen = []
  monkeypatch.setattr(_launcher, "launch", lambda cmd, **kw: seen.append((cmd, kw)) or 0)
  argv = ["--nproc", "3", "--devices-per-process", "2", "--init-timeout", "7", "--port", "1234", "--",
          PY, "-c", "pass"]
  assert cli.main(["launch", *argv]) == 0
  assert _launcher.main(argv) == 0
  assert seen[0] == seen[1]
  assert seen[0] == ([PY, "-c", "pass"], dict(nproc=3, port=1234, coordinator=None, gloo_interface=None,
                                              devices_per_process=2, init_timeout_s=7))


def test_launch_errors_are_prophet_errors_and_print_one_line(monkeypatch, capsys):
  from prophet_jax import GlooBindError, LaunchError, ProphetError, cli
  from prophet_jax._multiprocess import _launcher

  assert issubclass(LaunchError, ProphetError) and issubclass(GlooBindError, ProphetError)

  def fail(cmd, **kw):
    raise GlooBindError("jax 9.9 lacks the private call")

  monkeypatch.setattr(_launcher, "launch", fail)
  for main in (lambda a: cli.main(["launch", *a]), _launcher.main):
    assert main(["--nproc", "2", "--", PY, "-c", "pass"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "GlooBindError: jax 9.9 lacks the private call" in err, err


# -- the launcher with plain commands (no jax: fast) -----------------------------------------------


def test_launch_prefixes_output_and_sets_environment(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  code = ("import os; print(os.environ['PROPHET_PROCESS_ID'], os.environ['PROPHET_NUM_PROCESSES'], "
          "os.environ['PROPHET_COORDINATOR'], os.environ['XLA_FLAGS'], os.environ['PROPHET_LOCAL_DEVICES'])")
  rc, out, err, _ = _run_launch([PY, "-c", code], nproc=2, port=12345)
  assert rc == 0, err
  lines = sorted(out.splitlines())
  assert lines == [f"[rank {r}] {r} 2 127.0.0.1:12345 --xla_force_host_platform_device_count=4 4"
                   for r in (0, 1)]


def test_launch_stops_the_others_and_returns_the_failed_code():
  script = "if [ \"$PROPHET_PROCESS_ID\" = 1 ]; then sleep 0.3; exit 3; fi; exec sleep 60"
  rc, out, err, dt = _run_launch(["sh", "-c", script], nproc=3, devices_per_process=1)
  assert rc == 3
  assert "rank 1" in err and "exit code 3" in err and "stopping rank(s) [0, 2]" in err
  assert dt < 20, f"launch took {dt:.1f} s to stop the others"


def test_launch_reports_a_signal_as_128_plus_signum():
  script = "if [ \"$PROPHET_PROCESS_ID\" = 0 ]; then kill -9 $$; fi; exec sleep 60"
  rc, _, err, _ = _run_launch(["sh", "-c", script], nproc=2)
  assert rc == 128 + signal.SIGKILL and "rank 0" in err and "SIGKILL" in err


# -- real jax.distributed processes ----------------------------------------------------------------


def _env(**extra):
  env = dict(os.environ)
  env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu", **extra)
  return env


@pytest.fixture(scope="module")
def failed_joins():
  """Two processes that fail to join, started at once (each mostly waits: on a timeout, on jaxlib's
  abort): rank 1 of 2 with nobody listening at the coordinator's port, and rank 0 alone. name ->
  (the finished process, its stderr, seconds it took)."""
  ports = {"unreachable": free_port(), "alone": free_port()}
  envs = {"unreachable": _env(PROPHET_PROCESS_ID="1", PROPHET_NUM_PROCESSES="2", PROPHET_INIT_TIMEOUT_S="2",
                              PROPHET_COORDINATOR=f"127.0.0.1:{ports['unreachable']}"),
          "alone": _env(PROPHET_PROCESS_ID="0", PROPHET_NUM_PROCESSES="2", PROPHET_INIT_TIMEOUT_S="1",
                        PROPHET_COORDINATOR=f"127.0.0.1:{ports['alone']}")}
  t0 = time.monotonic()
  procs = {name: subprocess.Popen([PY, "-c", "from prophet_jax.launch import initialize; initialize()"],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for name, env in envs.items()}
  out = {}
  for name, p in procs.items():
    _, err = p.communicate(timeout=60)
    out[name] = (p, err, time.monotonic() - t0, ports[name])
  return out


@pytest.mark.multiprocess
def test_unreachable_coordinator_is_a_clear_error_not_a_hang(failed_joins):
  p, err, dt, port = failed_joins["unreachable"]  # nobody listens at that port
  assert p.returncode != 0
  assert "LaunchError" in err and f"coordinator is unreachable (rank 1 of 2, coordinator 127.0.0.1:{port}" in err
  assert dt < 30


@pytest.mark.multiprocess
def test_rank0_alone_says_why_before_jaxlib_aborts(failed_joins):
  p, err, _, _ = failed_joins["alone"]
  assert p.returncode != 0
  assert "did not finish connecting (rank 0 of 2" in err and "Did every rank start?" in err


@pytest.mark.multiprocess
def test_gloo_bind_errors_clearly_without_distributed():
  code = ("from prophet_jax._multiprocess._distributed import bind_gloo_interface, GlooBindError\n"
          "try:\n  bind_gloo_interface('lo')\nexcept GlooBindError as e:\n  print('ERR', e)\n")
  r = subprocess.run([PY, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
  assert "ERR bind_gloo_interface() needs jax.distributed.initialize() first" in r.stdout, r.stderr


def test_broadcast_schedule_checks_the_tree_on_one_process():
  import numpy as np

  from prophet_jax import GradientProfile, NetworkModel, ScheduleMismatchError, plan
  from prophet_jax.launch import broadcast_schedule

  params = {"params": {"a": {"kernel": np.zeros((3, 4), np.float32)}, "b": {"bias": np.zeros(4, np.float32)}}}
  sched = plan(GradientProfile.from_params(params, backward_s=1e-3), NetworkModel.preset("1gbe", workers=2),
               "wfbp")
  assert broadcast_schedule(sched, params) is sched
  bad = {"params": {"a": {"kernel": np.zeros((3, 5), np.float32)}, "b": {"bias": np.zeros(4, np.float32)}}}
  with pytest.raises(ScheduleMismatchError, match="leaf 'params/a/kernel'.*shape \\(3, 4\\) float32"):
    broadcast_schedule(sched, bad)
  extra = {"params": {**params["params"], "c": {"w": np.zeros(2, np.float32)}}}
  with pytest.raises(ScheduleMismatchError, match="'params/c/w'.*covers 2 leaves, like"):
    broadcast_schedule(sched, extra)
  missing = {"params": {"a": params["params"]["a"]}}
  with pytest.raises(ScheduleMismatchError, match=r"'params/b/bias'.*tree has paths like \['params/a/kernel'\]"):
    broadcast_schedule(sched, missing)
  with pytest.raises(ValueError, match="expected a Schedule"):
    broadcast_schedule(None, params)
