"""The launcher: N local processes wired for `jax.distributed`, waited for (docs/design.md, "The launcher")."""

from __future__ import annotations

import argparse
import contextlib
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

from .._values._checks import check_int
from .._values._config import config
from ._distributed import check_interface
from .._values._errors import ProphetError

DEVICE_FLAG = "--xla_force_host_platform_device_count"
STOP_GRACE_S = 3.0


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port that is free on `host` right now (the OS picks it)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return int(s.getsockname()[1])


def _split_coordinator(coordinator: str | None, port: int | None) -> tuple[str, int | None]:
  if coordinator is None:
    return "127.0.0.1", port
  if not isinstance(coordinator, str) or not coordinator.strip():
    raise ValueError(f"launch(coordinator={coordinator!r}): give an address such as '127.0.0.1' or '10.0.0.1:12345'.")
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
  """This rank's environment: the parent's, less PROPHET_* but PROPHET_DEBUG and the timeouts, plus its own."""
  env = {k: v for k, v in base.items() if not k.startswith("PROPHET_") or k == "PROPHET_DEBUG"
         or (v and k in ("PROPHET_INIT_TIMEOUT_S", "PROPHET_HEARTBEAT_TIMEOUT_S"))}
  env.update(PROPHET_PROCESS_ID=str(rank), PROPHET_NUM_PROCESSES=str(nproc),
             PROPHET_COORDINATOR=coordinator, PYTHONUNBUFFERED="1")
  given = {"XLA_FLAGS": xla_flags or None, "PROPHET_LOCAL_DEVICES": devices,
           "PROPHET_GLOO_INTERFACE": gloo_interface or None,
           "PROPHET_INIT_TIMEOUT_S": None if init_timeout_s is None else int(init_timeout_s)}
  return env | {k: str(v) for k, v in given.items() if v is not None}


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
  live = [p for p in procs.values() if p.poll() is None]
  for p in live:
    with contextlib.suppress(ProcessLookupError):
      os.killpg(p.pid, signal.SIGTERM)
  deadline = time.monotonic() + grace_s
  while time.monotonic() < deadline and any(p.poll() is None for p in live):
    time.sleep(0.05)
  for p in [p for p in live if p.poll() is None]:
    with contextlib.suppress(ProcessLookupError):
      os.killpg(p.pid, signal.SIGKILL)
  for p in live:
    with contextlib.suppress(subprocess.TimeoutExpired):
      p.wait(timeout=10)


class _Interrupted(BaseException):
  pass


def launch(cmd: Sequence[str], *, nproc: int, port: int | None = None, coordinator: str | None = None,
           gloo_interface: str | None = None, devices_per_process: int | None = None,
           init_timeout_s: int | None = None, stdout: IO[str] | None = None,
           stderr: IO[str] | None = None) -> int:
  """Starts `nproc` local copies of `cmd` wired for jax.distributed and waits for them.

  Args:
    cmd: the command and its arguments, e.g. ['python', 'train.py'].
    nproc: number of processes (ranks 0 .. nproc-1).
    port, coordinator: the coordinator's port (default a free one) and address 'host' or 'host:port'.
    gloo_interface: the network interface the processes' gloo binds to (default gloo's own).
    devices_per_process: CPU devices of each process (default the parent's XLA_FLAGS count / nproc).
    init_timeout_s: seconds each process waits for the coordinator (default PROPHET_INIT_TIMEOUT_S, 60).
    stdout, stderr: where the ranks' prefixed output and the launcher's messages go.

  Returns:
    0 when every process exits 0, else the first failed one's code (128 + signal when killed); 130
    when the launcher itself is interrupted.

  Raises:
    ValueError: an empty command, nproc < 1, a bad port, address or device count.

  Example:
    >>> launch(["python", "train.py"], nproc=2)  # doctest: +SKIP
  """
  out = stdout or sys.stdout
  err = stderr or sys.stderr
  cmd = [str(c) for c in cmd]
  if not cmd:
    raise ValueError("launch: the command is empty; give it after `--`, e.g. "
                     "`prophet-jax launch --nproc 2 -- python train.py`.")
  check_int("launch", "nproc", nproc, lo=1)
  check_int("launch", "port", port, lo=1, hi=65535, none=True, fix="It is a TCP port.")
  check_int("launch", "devices_per_process", devices_per_process, lo=1, none=True)
  host, port = _split_coordinator(coordinator, port)
  if port is None:
    try:
      port = free_port(host)
    except OSError as e:
      raise ValueError(f"launch(coordinator={host!r}): cannot pick a free port on that address ({e}); "
                       f"give one with --port.") from None
  if gloo_interface is not None:
    check_interface(gloo_interface)
  base = dict(os.environ)
  config()  # the parent's PROPHET_* flags are checked here, so a typo fails before anything starts
  xla_flags, devices = _device_flags(base.get("XLA_FLAGS", ""), nproc, devices_per_process)
  lock = threading.Lock()
  procs: dict[int, subprocess.Popen] = {}
  pumps: list[threading.Thread] = []

  def on_term(signum: int, frame: Any) -> None:
    raise _Interrupted()

  def say(text: str) -> None:  # the launcher's own line on stderr, between the ranks' lines
    with lock:
      err.write(f"prophet-jax launch: {text}\n")
      err.flush()

  old_term = signal.signal(signal.SIGTERM, on_term) if threading.current_thread() is threading.main_thread() else None
  try:
    for rank in range(nproc):
      env = _child_env(base, rank=rank, nproc=nproc, coordinator=f"{host}:{port}", xla_flags=xla_flags,
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
    while True:  # until one rank fails (the first in rank order) or all have ended well
      codes = {r: p.poll() for r, p in procs.items()}
      failed = next(((r, c) for r, c in codes.items() if c not in (None, 0)), None)
      if failed is not None or all(c == 0 for c in codes.values()):
        break
      time.sleep(0.05)
    if failed is None:
      return 0
    rank, code = failed
    others = [r for r, p in procs.items() if p.poll() is None]
    say(f"rank {rank} (pid {procs[rank].pid}) failed with {_describe(code)}; stopping rank(s) "
        f"{others or 'none (all ended)'}.")
    return 128 - code if code < 0 else code  # the others are stopped below
  except (KeyboardInterrupt, _Interrupted):
    say(f"interrupted; stopping rank(s) {[r for r, p in procs.items() if p.poll() is None]}.")
    return 130
  finally:
    _stop(procs, STOP_GRACE_S)
    for t in pumps:
      t.join(timeout=5)
    if old_term is not None:
      signal.signal(signal.SIGTERM, old_term)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
  """The launcher's arguments, the same for `prophet-jax launch` and `python -m prophet_jax.launch`."""
  parser.add_argument("--nproc", type=int, required=True, help="number of processes (ranks 0 .. N-1)")
  parser.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
  parser.add_argument("--coordinator", default=None, help="ADDR or ADDR:PORT (default 127.0.0.1)")
  parser.add_argument("--gloo-interface", default=None, help="network interface gloo binds to")
  parser.add_argument("--devices-per-process", type=int, default=None,
                      help="CPU devices of each process (default: the parent's XLA_FLAGS count / N)")
  parser.add_argument("--init-timeout", type=int, default=None,
                      help="seconds each process waits for the coordinator (default 60)")
  parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ...")
  return parser


def run(args: argparse.Namespace) -> int:
  """`launch` with the arguments `add_arguments` parsed; the launched processes' exit code."""
  cmd = list(args.cmd)[1:] if args.cmd[:1] == ["--"] else list(args.cmd)
  return launch(cmd, nproc=args.nproc, port=args.port, coordinator=args.coordinator,
                gloo_interface=args.gloo_interface, devices_per_process=args.devices_per_process,
                init_timeout_s=args.init_timeout)


def main(argv: Sequence[str] | None = None) -> int:
  """`python -m prophet_jax.launch ARGS -- CMD ...`, as `prophet-jax launch`; an error is one line, exit 2."""
  parser = add_arguments(argparse.ArgumentParser(
      prog="python -m prophet_jax.launch", description="Start N local processes wired with jax.distributed."))
  args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
  try:
    return run(args)
  except (ProphetError, ValueError) as e:
    print(f"prophet-jax launch: {type(e).__name__}: {e}", file=sys.stderr)
    return 2
