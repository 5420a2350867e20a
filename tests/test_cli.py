"""The command line: simulate and plan as docs/design.md lists them; bad input prints one line, exits 2."""

import json
import subprocess
import sys

import pytest

from prophet_jax import GradientProfile, NetworkModel, Schedule
from prophet_jax.cli import main


def run(capsys, *argv):
  code = main(list(argv))
  out, err = capsys.readouterr()
  return code, out, err


def test_simulate_json_has_the_documented_fields(capsys):
  code, out, _ = run(capsys, "simulate", "--model", "resnet50", "--device", "v100", "--workers", "16",
                     "--network", "25gbe", "--json")
  assert code == 0
  obj = json.loads(out)
  assert set(obj) == {"model", "device", "workers", "cross_step", "network", "lower_bound_s", "results"}
  assert obj["model"] == "resnet50-v100" and obj["workers"] == 16 and obj["cross_step"] is False
  assert set(obj["network"]) == {"name", "alpha_s", "beta_s_per_byte"}
  names = [r["policy"] for r in obj["results"]]
  assert names == ["wfbp", "bucket", "xla", "mgwfbp", "priority", "prophet", "auto", "dlcp", "dear"]
  lossless = [r for r in obj["results"] if r["policy"] not in ("dlcp", "dear")]
  for r in lossless:
    assert set(r) == {"policy", "iteration_s", "idle_s", "allreduces", "vs_lower_bound"}
    assert r["vs_lower_bound"] >= 1 - 1e-9, r
  auto = next(r for r in obj["results"] if r["policy"] == "auto")
  assert auto["iteration_s"] <= min(r["iteration_s"] for r in lossless) * (1 + 1e-9)
  # dear (sharded, ZeRO-1) says so and counts its collectives; the bound covers it too
  de = obj["results"][-1]
  assert set(de) == set(lossless[0]) | {"sharded", "reduce_scatters", "all_gathers", "peak_memory_bytes"}
  assert de["sharded"] is True and de["peak_memory_bytes"] > 0
  assert de["allreduces"] == 0 and de["reduce_scatters"] >= 1 and de["all_gathers"] >= 1
  assert de["vs_lower_bound"] >= 1 - 1e-9
  # dlcp (max_defer 0.1 in this comparison) adds how much it defers; never slower than auto
  dl = obj["results"][-2]
  assert set(dl) == set(lossless[0]) | {"max_defer", "deferred_fraction"} and dl["max_defer"] == 0.1
  assert dl["iteration_s"] <= auto["iteration_s"] * (1 + 1e-12) and 0 <= dl["deferred_fraction"] <= 0.1


def test_simulate_under_pressure_from_a_network_file_and_a_flag(capsys, tmp_path):
  from prophet_jax import NetworkModel
  from prophet_jax._values._network import Pressure

  net = NetworkModel.preset("10gbe", workers=8).replace(
      pressure=Pressure(background_flows=0.3, tail_prob=0.01, tail_scale_s=0.002, samples=16))
  path = tmp_path / "net.json"
  path.write_text(net.to_json())
  code, out, _ = run(capsys, "simulate", "--model", "gpt2-h100", "--network", str(path), "--json",
                     "--policy", "auto", "dlcp", "--max-defer", "0.25")
  assert code == 0
  obj = json.loads(out)
  assert obj["network"]["pressure"] == net.pressure.to_dict()
  auto, dl = obj["results"]
  assert auto["iteration_p50_s"] <= auto["iteration_p99_s"]
  assert dl["iteration_s"] < 0.9 * auto["iteration_s"] and 0 < dl["deferred_fraction"] <= 0.25
  # the flag overrides the file's pressure ('none': calm) and the table shows the tail
  code, out, _ = run(capsys, "simulate", "--model", "gpt2-h100", "--network", str(path), "--json",
                     "--policy", "auto", "--pressure", "none")
  assert "pressure" not in json.loads(out)["network"]
  code, out, _ = run(capsys, "simulate", "--model", "gpt2-h100", "--workers", "8", "--network", "10gbe",
                     "--pressure", "background_flows=0.5,samples=8,seed=2")
  assert code == 0 and "p99 ms" in out and "mean of 8 samples (seed 2)" in out
  assert [l.split()[0] for l in out.splitlines()[4:]][-2:] == ["dlcp", "dear"]


def test_simulate_table_named_policies_cross_step_and_timeline(capsys, tmp_path):
  png = tmp_path / "t.png"
  code, out, _ = run(capsys, "simulate", "--model", "gpt2-h100", "--workers", "64", "--network",
                     "100gb-ib", "--policy", "priority", "prophet", "--cross-step", "--timeline", str(png))
  assert code == 0 and "pipelined step" in out
  lines = [l.split()[0] for l in out.splitlines()[2:]]
  assert lines == ["priority", "prophet"]
  assert png.stat().st_size > 10_000


def test_simulate_timeline_creates_missing_directories(capsys, tmp_path):
  png = tmp_path / "out" / "nested" / "x.png"  # neither directory exists
  code, _, err = run(capsys, "simulate", "--model", "resnet50", "--workers", "8", "--network", "10gbe",
                     "--policy", "wfbp", "--timeline", str(png))
  assert code == 0, err
  assert png.stat().st_size > 1_000


def test_plan_writes_a_schedule_from_profile_and_network_files(capsys, tmp_path):
  from prophet_jax.models import load_trace

  prof = tmp_path / "p.json"
  prof.write_text(load_trace("bert-base-v100").to_json())
  net = tmp_path / "n.json"
  net.write_text(NetworkModel.preset("10gbe", workers=4).to_json())
  out = tmp_path / "new_dir" / "s.json"  # the directory is created
  code, text, _ = run(capsys, "plan", "--profile", str(prof), "--network", str(net), "--workers", "32",
                      "--policy", "mgwfbp", "--out", str(out))
  assert code == 0 and "predicted iteration" in text
  s = Schedule.from_json(out.read_text())
  assert s.policy == "mgwfbp" and s.tree_fingerprint == GradientProfile.from_json(prof.read_text()).fingerprint()
  # dlcp with a budget writes its deferral groups; --max-defer belongs to dlcp only
  code, text, _ = run(capsys, "plan", "--profile", str(prof), "--network", str(net), "--policy", "dlcp",
                      "--max-defer", "0.1", "--out", str(out))
  s = Schedule.from_json(out.read_text())
  assert code == 0 and s.defers and s.max_deferred_fraction <= 0.1 and "deferral groups" in text
  code, _, err = run(capsys, "plan", "--profile", str(prof), "--network", str(net), "--policy", "auto",
                     "--max-defer", "0.1", "--out", str(out))
  assert code == 2 and "--max-defer is an option of policy 'dlcp', not 'auto'" in err


@pytest.mark.parametrize("argv, match", [
    (["simulate", "--model", "alexnet", "--workers", "4", "--network", "10gbe"], "--model 'alexnet'"),
    (["simulate", "--model", "alexnet", "--workers", "4", "--network", "10gbe"],
     "googlenet-k80 (development checkout only)"),
    (["simulate", "--model", "resnet50", "--workers", "4", "--network", "5gbe"], "--network '5gbe'"),
    (["simulate", "--model", "resnet50", "--network", "10gbe"], "a preset needs --workers"),
    (["simulate", "--model", "resnet50", "--workers", "4", "--network", "10gbe", "--policy", "fastest"],
     "fastest"),
    (["simulate", "--model", "resnet50", "--workers", "4", "--network", "10gbe", "--policy", "dlcp",
      "--max-defer", "1.5"], "max_defer=1.5"),
    (["simulate", "--model", "resnet50", "--workers", "4", "--network", "10gbe", "--pressure",
      "tail_prob=2"], "tail_prob=2.0"),
    (["simulate", "--model", "resnet50", "--workers", "4", "--network", "10gbe", "--pressure",
      "tails=0.1"], "'tails=0.1' is not NAME=VALUE"),
    (["audit", "--target", "h100", "--model", "cnn", "--schedule", "no/such/s.json"],
     "schedule file 'no/such/s.json' does not exist"),  # a NameError before issue 17
])
def test_bad_input_one_line_exit_2(capsys, argv, match):
  code, _, err = run(capsys, *argv)
  assert code == 2
  assert len(err.strip().splitlines()) == 1 and match in err


def test_help_marks_the_googlenet_trace_development_only(capsys):
  with pytest.raises(SystemExit):
    main(["simulate", "--help"])
  assert "googlenet-k80 in a development checkout only" in " ".join(capsys.readouterr().out.split())


def test_malformed_profile_json(capsys, tmp_path):
  bad = tmp_path / "bad.json"
  bad.write_text("{\"rows\": [")
  code, _, err = run(capsys, "plan", "--profile", str(bad), "--network", "10gbe", "--workers", "4",
                     "--out", str(tmp_path / "s.json"))
  assert code == 2 and "malformed JSON" in err


def test_debug_shows_the_traceback():
  out = subprocess.run([sys.executable, "-m", "prophet_jax", "simulate", "--debug", "--model", "x",
                        "--workers", "4", "--network", "10gbe"], capture_output=True, text=True, timeout=120)
  assert out.returncode != 0 and "Traceback" in out.stderr


def test_workers_must_be_positive(capsys):
  with pytest.raises(SystemExit) as e:
    main(["simulate", "--model", "resnet50", "--workers", "0", "--network", "10gbe"])
  assert e.value.code == 2
  assert "positive integer" in capsys.readouterr().err


def test_an_out_path_under_a_file_is_one_clear_line(capsys, tmp_path):
  (tmp_path / "f").write_text("")
  code, _, err = run(capsys, "plan", "--profile", str(tmp_path / "nope.json"), "--network", "10gbe",
                     "--workers", "4", "--out", str(tmp_path / "s.json"))
  assert code == 2 and "does not exist" in err
  from prophet_jax.models import load_trace

  prof = tmp_path / "p.json"
  prof.write_text(load_trace("bert-base-v100").to_json())
  code, _, err = run(capsys, "plan", "--profile", str(prof), "--network", "10gbe", "--workers", "4",
                     "--out", str(tmp_path / "f" / "s.json"))
  assert code == 2 and len(err.strip().splitlines()) == 1 and "is not a directory" in err


# -- the commands that run jax: small and quick (the suite's process has 8 CPU devices) -------------


def test_profile_writes_a_measured_profile(capsys, tmp_path):
  out = tmp_path / "a" / "p.json"
  code, text, err = run(capsys, "profile", "--model", "mlp", "--num-devices", "2", "--steps", "2",
                        "--out", str(out))
  assert code == 0, err
  prof = GradientProfile.from_json(out.read_text())
  assert prof.model == "mlp" and len(prof.rows) == 24 and prof.backward_s > 0
  assert all(r.ready_s >= 0 for r in prof.rows) and "written to" in text


def test_probe_fits_a_network_and_shows_progress(capsys, tmp_path):
  out = tmp_path / "b" / "n.json"
  code, text, err = run(capsys, "probe", "--num-devices", "2", "--sizes", "1024", "16384", "--repeats",
                        "3", "--out", str(out))
  assert code == 0, err
  net = NetworkModel.from_json(out.read_text())
  assert net.workers == 2 and net.overlap is False and net.fit_residual_s is not None
  assert "size 1/2 (1 KiB)" in err and "size 2/2 (16 KiB)" in err  # progress, on stderr
  assert "probe:cpux2:median" in text


def test_probe_rejects_more_devices_than_exist(capsys, tmp_path):
  code, _, err = run(capsys, "probe", "--num-devices", "64", "--sizes", "1024", "4096", "--out",
                     str(tmp_path / "n.json"))
  assert code == 2 and "num_devices=64" in err and len(err.strip().splitlines()) == 1


def test_launch_runs_a_trivial_command_on_two_ranks(capsys):
  code = "import os; print('hello from', os.environ['PROPHET_PROCESS_ID'], os.environ['PROPHET_NUM_PROCESSES'])"
  rc, out, err = run(capsys, "launch", "--nproc", "2", "--", sys.executable, "-c", code)
  assert rc == 0, err
  assert sorted(out.splitlines()) == ["[rank 0] hello from 0 2", "[rank 1] hello from 1 2"]
  rc, _, err = run(capsys, "launch", "--nproc", "2", "--", sys.executable, "-c",
                   "import os, sys; sys.exit(3 if os.environ['PROPHET_PROCESS_ID'] == '1' else 0)")
  assert rc == 3 and "rank 1" in err
  rc, _, err = run(capsys, "launch", "--nproc", "2")
  assert rc == 2 and "the command is empty; give it after `--`" in err


def test_dear_rows_and_plan_writes_a_sharded_schedule(capsys, tmp_path):
  from prophet_jax import NetworkModel, Schedule

  # a network with two links: sharded schedules run on one tie chain, so no dear row there
  path = tmp_path / "net.json"
  path.write_text(NetworkModel.preset("10gbe", workers=8, links=2).to_json())
  code, out, _ = run(capsys, "simulate", "--model", "resnet50", "--network", str(path), "--json")
  assert code == 0 and "dear" not in [r["policy"] for r in json.loads(out)["results"]]
  code, _, err = run(capsys, "simulate", "--model", "resnet50", "--network", str(path), "--policy", "dear")
  assert code == 2 and "network.links=2" in err
  # plan --policy dear writes a sharded schedule that loads
  prof = tmp_path / "p.json"
  from prophet_jax import models
  prof.write_text(models.load_trace("resnet50-v100").to_json())
  out_path = tmp_path / "s.json"
  code, _, _ = run(capsys, "plan", "--profile", str(prof), "--network", "10gbe", "--workers", "16",
                   "--policy", "dear", "--cross-step", "--out", str(out_path))
  assert code == 0
  s = Schedule.from_json(out_path.read_text())
  assert s.policy == "dear" and s.sharded and s.cross_step and "gathers" in json.loads(out_path.read_text())
