"""Multi-process bootstrap: start N local processes wired for `jax.distributed`, and join them.

Two halves:

* `launch(cmd, nproc=N, ...)` (the `prophet-jax launch --nproc N -- CMD ...` command, also
  `python -m prophet_jax.launch --nproc N -- CMD ...`) starts N copies of CMD on this host. Each gets
  the environment variables below, its own CPU device count (XLA_FLAGS reaches children, so the
  launcher rewrites `--xla_force_host_platform_device_count` per process: with 8 in the parent and
  `--nproc 2`, each process gets 4, keeping the global device count), and its output lines prefixed
  with `[rank k] `. When one process fails, the launcher stops the others (SIGTERM, then SIGKILL after
  a grace period), names the failed rank on stderr and exits with that process's code (128 + signal
  number for a process killed by a signal, as shells report it).

* `initialize()`, called by the training script before any other jax call, reads those variables and
  calls `jax.distributed.initialize(coordinator, num_processes, process_id)` with a short
  initialization timeout, so an unreachable coordinator fails with a clear `LaunchError` instead of a
  hang. With `PROPHET_GLOO_INTERFACE` set it first binds gloo (jax's CPU collectives) to that interface
  (FACTS.md: in network namespaces the hostname resolves to 127.0.0.1).

Environment set by `launch` for each process (read through `prophet_jax._config`):

  PROPHET_PROCESS_ID      rank of this process, 0 .. N-1
  PROPHET_NUM_PROCESSES   N
  PROPHET_COORDINATOR     'host:port' of the coordinator (rank 0 serves it); default 127.0.0.1 and a
                          free port
  PROPHET_GLOO_INTERFACE  interface gloo binds to (only with --gloo-interface)
  PROPHET_INIT_TIMEOUT_S  seconds to wait for the coordinator (default 60)
  PROPHET_HEARTBEAT_TIMEOUT_S  passed on from the parent: seconds without a heartbeat before
                          jax.distributed declares a process dead (default jax's 100)
  PROPHET_LOCAL_DEVICES   CPU devices of this process (only when the launcher set the count)
  XLA_FLAGS               the parent's, with --xla_force_host_platform_device_count per process
  PYTHONUNBUFFERED=1      so output lines arrive as they are printed

On a real cluster: do not use `launch`. Start one process per host with your scheduler (SLURM, Open
MPI, Kubernetes, Cloud TPU); `initialize()` sees no PROPHET_* process variables and calls
`jax.distributed.initialize()` with no arguments, so jax's own cluster detection finds the
coordinator, the process count and the ranks. (JAX_COORDINATOR_ADDRESS also triggers that path.)
Without launch and without a cluster, `initialize()` does nothing and the script runs as one process.
The training script is the same in all three cases.

The schedule is planned on rank 0 and broadcast with `broadcast_schedule`; every process then checks
that the schedule's rows (path, shape, dtype) match its own parameter tree, and all processes fail
together, naming the rank, when one does not match.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

from ._config import config
from ._errors import ProphetError, ScheduleMismatchError
from ._types import Schedule

__all__ = ["LaunchError", "launch", "main", "initialize", "broadcast_schedule", "check_schedule_tree",
           "free_port"]

DEVICE_FLAG = "--xla_force_host_platform_device_count"
STOP_GRACE_S = 3.0


class LaunchError(ProphetError, RuntimeError):
  """A multi-process run could not start or lost a process: the coordinator was unreachable within
  the initialization timeout, or the processes disagree about the schedule. Check that rank 0 is
  running and that the coordinator address and port are reachable from every process."""


# --------------------------------------------------------------------------------------------------
# the launcher


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port that is free on `host` right now (the OS picks it)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return int(s.getsockname()[1])


def _split_coordinator(coordinator: str | None, port: int | None) -> tuple[str, int | None]:
  if coordinator is None:
    return "127.0.0.1", port
  if not isinstance(coordinator, str) or not coordinator.strip():
    raise ValueError(f"launch(coordinator={coordinator!r}): give an address such as '127.0.0.1' or "
                     f"'10.0.0.1:12345'.")
  host, sep, tail = coordinator.strip().rpartition(":")
  if sep and tail.isdigit() and ":" not in host:
    if port is not None and int(tail) != port:
      raise ValueError(f"launch(coordinator={coordinator!r}, port={port}): the address names port "
                       f"{tail} but port={port}; give the port once.")
    return host, int(tail)
  return coordinator.strip(), port


def _device_flags(xla_flags: str, nproc: int, devices_per_process: int | None) -> tuple[str, int | None]:
  """The XLA_FLAGS of one child, and its device count (None: left as the parent's flags say)."""
  found = re.findall(rf"{DEVICE_FLAG}=(\S*)", xla_flags)
  if devices_per_process is None:
    if not found:
      return xla_flags, None
    try:
      total = int(found[-1])
    except ValueError:
      raise ValueError(f"XLA_FLAGS has {DEVICE_FLAG}={found[-1]!r}, not an integer.") from None
    if total % nproc:
      raise ValueError(f"XLA_FLAGS asks for {total} CPU devices, which do not split evenly over "
                       f"nproc={nproc} processes; pass devices_per_process (--devices-per-process) or "
                       f"a device count divisible by {nproc}.")
    devices_per_process = total // nproc
  rest = re.sub(rf"\s*{DEVICE_FLAG}=\S*", "", xla_flags).strip()
  return f"{rest} {DEVICE_FLAG}={devices_per_process}".strip(), devices_per_process


def _child_env(base: dict[str, str], *, rank: int, nproc: int, coordinator: str, xla_flags: str,
               devices: int | None, gloo_interface: str | None, init_timeout_s: int | None) -> dict[str, str]:
  env = {k: v for k, v in base.items() if not k.startswith("PROPHET_") or k == "PROPHET_DEBUG"}
  env.update(PROPHET_PROCESS_ID=str(rank), PROPHET_NUM_PROCESSES=str(nproc),
             PROPHET_COORDINATOR=coordinator, PYTHONUNBUFFERED="1")
  if xla_flags:
    env["XLA_FLAGS"] = xla_flags
  if devices is not None:
    env["PROPHET_LOCAL_DEVICES"] = str(devices)
  if gloo_interface:
    env["PROPHET_GLOO_INTERFACE"] = gloo_interface
  if init_timeout_s is not None:
    env["PROPHET_INIT_TIMEOUT_S"] = str(int(init_timeout_s))
  elif base.get("PROPHET_INIT_TIMEOUT_S"):
    env["PROPHET_INIT_TIMEOUT_S"] = base["PROPHET_INIT_TIMEOUT_S"]
  if base.get("PROPHET_HEARTBEAT_TIMEOUT_S"):
    env["PROPHET_HEARTBEAT_TIMEOUT_S"] = base["PROPHET_HEARTBEAT_TIMEOUT_S"]
  return env


def _pump(rank: int, stream: IO[bytes], out: IO[str], lock: threading.Lock) -> None:
  prefix = f"[rank {rank}] "
  for raw in iter(stream.readline, b""):
    line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
    with lock:
      out.write(prefix + line + "\n")
      out.flush()
  stream.close()


def _describe(code: int) -> str:
  if code < 0:
    try:
      name = signal.Signals(-code).name
    except ValueError:
      name = f"signal {-code}"
    return f"exit code {128 - code} (killed by {name})"
  return f"exit code {code}"


def _stop(procs: dict[int, subprocess.Popen], grace_s: float) -> None:
  """SIGTERM every live process group, then SIGKILL what is left after `grace_s`."""
  live = {r: p for r, p in procs.items() if p.poll() is None}
  for p in live.values():
    try:
      os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
      pass
  deadline = time.monotonic() + grace_s
  while time.monotonic() < deadline and any(p.poll() is None for p in live.values()):
    time.sleep(0.05)
  for p in live.values():
    if p.poll() is None:
      try:
        os.killpg(p.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
  for p in live.values():
    try:
      p.wait(timeout=10)
    except subprocess.TimeoutExpired:
      pass


class _Interrupted(BaseException):
  pass


def launch(cmd: Sequence[str], *, nproc: int, port: int | None = None, coordinator: str | None = None,
           gloo_interface: str | None = None, devices_per_process: int | None = None,
           init_timeout_s: int | None = None, stdout: IO[str] | None = None,
           stderr: IO[str] | None = None) -> int:
  """Starts `nproc` local copies of `cmd` wired for jax.distributed and waits for them.

  Args:
    cmd: the command and its arguments, e.g. ['python', 'train.py', '--steps', '5'].
    nproc: number of processes (ranks 0 .. nproc-1).
    port: coordinator port; default a free port on the coordinator host.
    coordinator: coordinator address 'host' or 'host:port' (rank 0 serves it); default 127.0.0.1.
    gloo_interface: network interface the processes' gloo binds to (e.g. a veth); default gloo's own.
    devices_per_process: CPU devices of each process (rewrites --xla_force_host_platform_device_count
      in XLA_FLAGS). Default: the parent's count divided by nproc when XLA_FLAGS sets one, else
      untouched.
    init_timeout_s: seconds each process waits for the coordinator (PROPHET_INIT_TIMEOUT_S); default
      the parent's PROPHET_INIT_TIMEOUT_S, else 60.
    stdout, stderr: where the prefixed output and the launcher's messages go (default sys.stdout,
      sys.stderr).

  Returns:
    0 when every process exits 0; otherwise the exit code of the first process that failed (128 +
    signal number when it was killed by a signal), after the others were stopped. 130 when the
    launcher itself is interrupted.

  Raises:
    ValueError: an empty command, nproc < 1, a bad port, address or device count.
  """
  out = stdout or sys.stdout
  err = stderr or sys.stderr
  cmd = [str(c) for c in cmd]
  if not cmd:
    raise ValueError("launch: the command is empty; give it after `--`, e.g. "
                     "`prophet-jax launch --nproc 2 -- python train.py`.")
  if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
    raise ValueError(f"launch(nproc={nproc!r}): nproc must be an integer >= 1.")
  if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
    raise ValueError(f"launch(port={port!r}): a TCP port is an integer in [1, 65535].")
  if devices_per_process is not None and (isinstance(devices_per_process, bool)
                                          or not isinstance(devices_per_process, int)
                                          or devices_per_process < 1):
    raise ValueError(f"launch(devices_per_process={devices_per_process!r}): must be an integer >= 1.")
  host, port = _split_coordinator(coordinator, port)
  if port is None:
    try:
      port = free_port(host)
    except OSError as e:
      raise ValueError(f"launch(coordinator={host!r}): cannot pick a free port on that address ({e}); "
                       f"give one with --port.") from None
  if gloo_interface is not None:
    from ._gloo import check_interface

    check_interface(gloo_interface)
  base = dict(os.environ)
  config()  # the parent's PROPHET_* flags are checked here, so a typo fails before anything starts
  xla_flags, devices = _device_flags(base.get("XLA_FLAGS", ""), nproc, devices_per_process)
  address = f"{host}:{port}"
  lock = threading.Lock()
  procs: dict[int, subprocess.Popen] = {}
  pumps: list[threading.Thread] = []

  def on_term(signum: int, frame: Any) -> None:
    raise _Interrupted()

  old_term = None
  if threading.current_thread() is threading.main_thread():
    old_term = signal.signal(signal.SIGTERM, on_term)
  failed: tuple[int, int] | None = None
  try:
    for rank in range(nproc):
      env = _child_env(base, rank=rank, nproc=nproc, coordinator=address, xla_flags=xla_flags,
                       devices=devices, gloo_interface=gloo_interface, init_timeout_s=init_timeout_s)
      try:
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
      except OSError as e:
        raise ValueError(f"launch: cannot start {shlex.join(cmd)!r} ({e}).") from None
      procs[rank] = p
      t = threading.Thread(target=_pump, args=(rank, p.stdout, out, lock), daemon=True)
      t.start()
      pumps.append(t)
    while True:
      codes = {r: p.poll() for r, p in procs.items()}
      bad = [(r, c) for r, c in codes.items() if c not in (None, 0)]
      if bad:
        failed = bad[0]
        break
      if all(c == 0 for c in codes.values()):
        break
      time.sleep(0.05)
    if failed is not None:
      rank, code = failed
      others = [r for r, p in procs.items() if p.poll() is None]
      with lock:
        err.write(f"prophet-jax launch: rank {rank} (pid {procs[rank].pid}) failed with "
                  f"{_describe(code)}; stopping rank(s) {others or 'none (all ended)'}.\n")
        err.flush()
      _stop(procs, STOP_GRACE_S)
      return 128 - code if code < 0 else code
    return 0
  except (KeyboardInterrupt, _Interrupted):
    with lock:
      err.write(f"prophet-jax launch: interrupted; stopping rank(s) "
                f"{[r for r, p in procs.items() if p.poll() is None]}.\n")
      err.flush()
    return 130
  finally:
    _stop(procs, STOP_GRACE_S)
    for t in pumps:
      t.join(timeout=5)
    if old_term is not None:
      signal.signal(signal.SIGTERM, old_term)


def main(argv: Sequence[str] | None = None) -> int:
  """`python -m prophet_jax.launch --nproc N [--port P] [--coordinator ADDR] [--gloo-interface IF]
  [--devices-per-process D] [--init-timeout S] -- CMD ...`."""
  import argparse

  p = argparse.ArgumentParser(prog="python -m prophet_jax.launch",
                              description="Start N local processes wired with jax.distributed.")
  p.add_argument("--nproc", type=int, required=True)
  p.add_argument("--port", type=int, default=None)
  p.add_argument("--coordinator", default=None, help="ADDR or ADDR:PORT (default 127.0.0.1)")
  p.add_argument("--gloo-interface", default=None)
  p.add_argument("--devices-per-process", type=int, default=None)
  p.add_argument("--init-timeout", type=int, default=None, help="seconds to wait for the coordinator")
  p.add_argument("cmd", nargs=argparse.REMAINDER)
  a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
  cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
  try:
    return launch(cmd, nproc=a.nproc, port=a.port, coordinator=a.coordinator,
                  gloo_interface=a.gloo_interface, devices_per_process=a.devices_per_process,
                  init_timeout_s=a.init_timeout)
  except (ProphetError, ValueError) as e:
    print(f"prophet-jax launch: {type(e).__name__}: {e}", file=sys.stderr)
    return 2


# --------------------------------------------------------------------------------------------------
# inside each process


def _cluster_detected() -> bool:
  """True when jax's own cluster detection would find a cluster (SLURM, Open MPI, k8s, Cloud TPU)."""
  if os.environ.get("JAX_COORDINATOR_ADDRESS"):
    return True
  try:
    from jax._src.clusters import ClusterEnv

    return any(not env.opt_in_only_method and env.is_env_present() for env in ClusterEnv._cluster_types)
  except Exception:  # noqa: BLE001 - a private API: when it moved, assume no cluster
    return False


def _wait_for_coordinator(address: str, deadline: float, where: str) -> None:
  """Polls a TCP connection to the coordinator until it answers or the deadline passes."""
  host, _, port = address.rpartition(":")
  last: Exception | None = None
  while True:
    try:
      with socket.create_connection((host, int(port)), timeout=1.0):
        return
    except OSError as e:
      last = e
    if time.monotonic() >= deadline:
      raise LaunchError(f"the jax.distributed coordinator is unreachable ({where}): {last}. Is rank 0 "
                        f"running, and is {address} reachable from this process? Start all ranks with "
                        f"`prophet-jax launch`, or raise PROPHET_INIT_TIMEOUT_S.")
    time.sleep(0.2)


def initialize(*, timeout_s: int | None = None) -> bool:
  """Joins the multi-process run this process belongs to; call it before any other jax call.

  Under `launch` (PROPHET_* process variables set): binds gloo to PROPHET_GLOO_INTERFACE if given, then
  `jax.distributed.initialize(coordinator, num_processes, process_id)`. On a cluster that jax detects
  itself (SLURM, Open MPI, Kubernetes, Cloud TPU, or JAX_COORDINATOR_ADDRESS): plain
  `jax.distributed.initialize()`. Otherwise nothing (one process).

  Args:
    timeout_s: seconds to wait for the coordinator and the other processes; default
      PROPHET_INIT_TIMEOUT_S, else 60.

  Returns:
    True when jax.distributed is initialized (now or before), False for a single process.

  Raises:
    LaunchError: the coordinator was not reachable in time (names the address and the rank).
    ValueError: malformed PROPHET_* variables (names the variable).
  """
  import jax

  cfg = config()
  if jax.distributed.is_initialized():
    return True
  timeout = int(timeout_s if timeout_s is not None else cfg.init_timeout_s)
  if not cfg.launched:
    if not _cluster_detected():
      return False
    jax.distributed.initialize(initialization_timeout=timeout)
    return True
  where = (f"rank {cfg.process_id} of {cfg.num_processes}, coordinator {cfg.coordinator}, "
           f"timeout {timeout} s")
  deadline = time.monotonic() + timeout
  if cfg.process_id != 0:
    _wait_for_coordinator(cfg.coordinator, deadline, where)
  # jaxlib ends the process (a fatal log, exit 134) when the other ranks do not all register in time;
  # say clearly why before it does.
  watchdog = threading.Timer(max(timeout - 0.5, 0.1), lambda: print(
      f"prophet_jax.launch.initialize: jax.distributed did not finish connecting ({where}); jaxlib is "
      f"about to abort this process. Did every rank start? Check the other ranks' output, or raise "
      f"PROPHET_INIT_TIMEOUT_S.", file=sys.stderr, flush=True))
  watchdog.daemon = True
  watchdog.start()
  try:
    jax.distributed.initialize(cfg.coordinator, num_processes=cfg.num_processes,
                               process_id=cfg.process_id, cluster_detection_method="deactivate",
                               initialization_timeout=timeout,
                               **({"heartbeat_timeout_seconds": cfg.heartbeat_timeout_s}
                                  if cfg.heartbeat_timeout_s else {}))
  except Exception as e:  # noqa: BLE001 - jaxlib raises its own runtime error types
    try:
      jax.distributed.shutdown()
    except Exception:  # noqa: BLE001
      pass
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise LaunchError(
        f"jax.distributed could not connect ({where}): {first[:300]}. Is rank 0 running, and is "
        f"{cfg.coordinator} reachable from this process? Start all ranks with `prophet-jax launch` or "
        f"raise PROPHET_INIT_TIMEOUT_S.") from e
  finally:
    watchdog.cancel()
  if cfg.gloo_interface:
    from ._gloo import bind_gloo_interface

    bind_gloo_interface(cfg.gloo_interface)
  return True


def check_schedule_tree(schedule: Schedule, params: Any) -> None:
  """Checks that `schedule` was planned for `params`: the same float leaves, by path, shape and dtype.

  Raises:
    ScheduleMismatchError: naming the first path that is missing, extra, or of another shape or dtype.
  """
  import numpy as np

  from ._tree import flatten_with_paths

  mine: dict[str, tuple[tuple[int, ...], str]] = {}
  for path, leaf in flatten_with_paths(params):
    dt = np.dtype(leaf.dtype)
    if np.issubdtype(dt, np.inexact) or dt.name == "bfloat16":
      mine[path] = (tuple(int(d) for d in leaf.shape), dt.name)
  planned = {p: (tuple(s), d) for p, s, d in schedule.rows}
  paths = list(mine)
  like = f"this process's tree has paths like {paths[:4]}" + (f" and {len(paths) - 4} more" if len(paths) > 4
                                                              else "")
  for p, (s, d) in planned.items():
    if p not in mine:
      raise ScheduleMismatchError(f"the schedule has leaf {p!r}, which this process's params lack ({like});"
                                  f" plan again on the current params.")
    if mine[p] != (s, d):
      raise ScheduleMismatchError(f"leaf {p!r}: the schedule was planned for shape {s} {d}, but this "
                                  f"process has {mine[p][0]} {mine[p][1]}; plan again on the current "
                                  f"params.")
  extra = sorted(set(mine) - set(planned))
  if extra:
    raise ScheduleMismatchError(f"this process's params have leaf {extra[0]!r} (and {len(extra) - 1} "
                                f"more) that the schedule does not cover (it covers {len(planned)} leaves, "
                                f"like {list(planned)[:4]}); plan again on the current params.")


_MESSAGE_BYTES = 600  # each rank's error message, as gathered for the others (truncated)


def _gather_messages(text: str) -> list[str]:
  """Every process's `text` (at most _MESSAGE_BYTES bytes of it), in rank order."""
  import numpy as np
  from jax.experimental import multihost_utils

  raw = text.encode()[:_MESSAGE_BYTES]
  buf = np.zeros(_MESSAGE_BYTES + 1, np.uint8)
  buf[0] = len(raw) > 0
  buf[1:1 + len(raw)] = np.frombuffer(raw, np.uint8)
  rows = np.asarray(multihost_utils.process_allgather(buf)).reshape(-1, _MESSAGE_BYTES + 1)
  return [bytes(r[1:]).rstrip(b"\0").decode(errors="replace") if r[0] else "" for r in rows]


def broadcast_schedule(schedule: Schedule | BaseException | None, params: Any = None) -> Schedule:
  """Sends rank 0's schedule to every process; each checks it against its own params.

  Rank 0 passes the schedule it planned (the others may pass None; their value is ignored), or the
  exception that stopped it planning: every process takes part in the broadcast either way, so when
  rank 0 has no schedule the others fail at once with its message (a LaunchError) instead of waiting
  in a collective until a timeout. The schedule travels as JSON bytes through
  `jax.experimental.multihost_utils.broadcast_one_to_all`; every process rebuilds it (which checks the
  rows against the stored fingerprint) and, given `params`, checks it against its own tree. The
  processes then agree on the outcome, so all fail together when one does not match: the mismatching
  rank with the mismatch (naming its rank), every other rank with a LaunchError that names the ranks
  and quotes the first one's message.

  Args:
    schedule: the planned schedule on rank 0, or the exception planning raised there (anything on
      other ranks).
    params: this process's parameter tree (optional; checked by path, shape and dtype).

  Returns:
    The schedule, identical on every process.

  Raises:
    ValueError: rank 0 passed no Schedule (or the exception rank 0 passed, re-raised there).
    ScheduleMismatchError: this process's params do not match the schedule.
    LaunchError: another process reported a mismatch, or rank 0 had no schedule to send.

  Example:
    >>> schedule = plan(profile, network, "auto") if jax.process_index() == 0 else None  # doctest: +SKIP
    >>> schedule = broadcast_schedule(schedule, params)                                   # doctest: +SKIP
  """
  import jax
  import numpy as np

  rank0_error: BaseException | None = None
  if not isinstance(schedule, Schedule):
    rank0_error = (schedule if isinstance(schedule, BaseException) else
                   ValueError(f"broadcast_schedule: expected a Schedule on rank 0 (the planned one, or "
                              f"the exception that stopped it planning), got {type(schedule).__name__}."))
  if jax.process_count() == 1:
    if rank0_error is not None:
      raise rank0_error
    if params is not None:
      check_schedule_tree(schedule, params)
    return schedule
  from jax.experimental import multihost_utils

  rank = jax.process_index()
  if rank == 0:
    text = (schedule.to_json() if rank0_error is None
            else f"{type(rank0_error).__name__}: {rank0_error}")
    payload = text.encode()
  else:
    payload = b""
  header = np.asarray([len(payload), 0 if rank != 0 or rank0_error is None else 1], np.int32)
  header = np.asarray(multihost_utils.broadcast_one_to_all(header))
  n, failed = int(header[0]), bool(header[1])
  buf = np.zeros(n, np.uint8)
  if rank == 0:
    buf[:] = np.frombuffer(payload, np.uint8)
  text = bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf)).astype(np.uint8)).decode()
  if failed:
    if rank == 0:
      raise rank0_error  # type: ignore[misc]
    raise LaunchError(f"rank {rank}: rank 0 sent no schedule; it failed before broadcasting it with "
                      f"{text}. Fix that on rank 0 (see its output); this rank stops with it.")
  error: Exception | None = None
  try:
    got = Schedule.from_json(text)
    if params is not None:
      check_schedule_tree(got, params)
  except ProphetError as e:
    error = type(e)(f"rank {rank}: {e}")
    error.__cause__ = e
  messages = _gather_messages("" if error is None else str(error))
  if error is not None:
    raise error
  bad = [r for r, m in enumerate(messages) if m]
  if bad:
    raise LaunchError(f"rank {rank}: rank(s) {bad} found that rank 0's schedule (fingerprint "
                      f"{got.tree_fingerprint}) does not match their params. {messages[bad[0]]}")
  return got


if __name__ == "__main__":
  sys.exit(main())
