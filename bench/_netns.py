"""Two network namespaces joined by a veth pair, shaped with `tc ... tbf`: the benches' private link.

`shaped_link(rate)` creates namespaces `pjx<pid>a` and `pjx<pid>b` (this process's pid, so runs never
collide), a veth pair whose ends are both named `pjxveth` inside their namespaces (so one
`PROPHET_GLOO_INTERFACE` fits both ranks), addresses 10.213.<x>.1/24 and .2/24 (inside these
namespaces only: nothing outside them is touched or reached), loopback up in each, and a tbf qdisc of
the given rate on both ends' egress. Every namespace it creates is deleted by name on exit from the
`with` block, on an exception, and at interpreter exit (atexit), whichever comes first; deleting a
namespace deletes the veth end inside it.

Needs root, `ip` and `tc` (iproute2). `skip_reason()` says why not, for a clear skip.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

IFACE = "pjxveth"
_CREATED: list[str] = []  # namespaces this process created and has not deleted yet


def skip_reason() -> str | None:
  """None when shaped links can be made here, else a one-line reason."""
  if os.geteuid() != 0:
    return "needs root (network namespaces and tc); run as root or skip the shaped-link bench"
  for tool in ("ip", "tc"):
    if shutil.which(tool) is None:
      return f"`{tool}` not found; install iproute2 (apt-get install iproute2)"
  return None


def _sh(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
  r = subprocess.run(list(args), capture_output=True, text=True)
  if check and r.returncode:
    raise RuntimeError(f"`{' '.join(args)}` failed ({r.returncode}): {r.stderr.strip()}")
  return r


def delete_namespace(name: str) -> None:
  """Deletes the namespace `name` if it exists (and forgets it)."""
  _sh(["ip", "netns", "del", name], check=False)
  if name in _CREATED:
    _CREATED.remove(name)


def _cleanup_all() -> None:
  for name in list(_CREATED):
    delete_namespace(name)


atexit.register(_cleanup_all)


_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}


def rate_bytes_per_s(rate: str) -> float:
  """'1gbit' -> 1.25e8 bytes/s (tc's kbit, mbit, gbit)."""
  text = rate.strip().lower()
  for unit, mult in _UNITS.items():
    if text.endswith(unit):
      return float(text[: -len(unit)]) * mult / 8
  raise ValueError(f"rate={rate!r}: expected a tc rate such as '1gbit' or '100mbit'.")


def _tbf(ns: str, rate: str) -> list[str]:
  # burst: 0.5 ms of traffic at the rate (at least 16 KiB). A bucket larger than one step's gradients
  # would let a whole step's all-reduce through unshaped after each compute pause; latency bounds
  # the queue.
  burst = max(int(rate_bytes_per_s(rate) * 5e-4), 16 * 1024)
  return ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", IFACE, "root", "tbf", "rate", rate,
          "burst", str(burst), "latency", "200ms"]


def fit_absolute(sizes, seconds, *, workers: int, overlap: bool, name: str):
  """alpha, beta by least squares in ABSOLUTE seconds over per-size medians (a, b >= 0).

  An iteration is a sum of seconds that large messages dominate; a relative-error fit lets one 4 ms
  scheduler tick on a 1 KiB message (common on this loaded machine) pull beta far down.
  """
  import numpy as np

  from prophet_jax import NetworkModel

  x = np.asarray(sizes, np.float64)
  y = np.asarray(seconds, np.float64)
  (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], 1), y, rcond=None)
  if b < 0:
    a, b = float(np.mean(y)), 0.0
  if a < 0:
    a, b = 0.0, float(x @ y / (x @ x))
  p = int(workers)
  resid = float(np.sqrt(np.mean((a + b * x - y) ** 2)))
  return NetworkModel(alpha_s=a / (2 * (p - 1)), beta_s_per_byte=b * p / (2 * (p - 1)), workers=p,
                      overlap=overlap, name=name, fit_residual_s=resid)


@dataclass(frozen=True)
class Link:
  """A shaped veth link: rank k runs in `namespaces[k]` and owns `addresses[k]`."""

  namespaces: tuple[str, str]
  addresses: tuple[str, str]
  rate: str
  iface: str = IFACE

  def exec_prefix(self, rank: int) -> list[str]:
    """The command prefix that runs a program in rank `rank`'s namespace."""
    return ["ip", "netns", "exec", self.namespaces[rank]]

  def set_rate(self, rate: str) -> Link:
    """Re-shapes both ends to `rate` (e.g. '1gbit', '100mbit')."""
    for ns in self.namespaces:
      _sh(_tbf(ns, rate))
    return Link(self.namespaces, self.addresses, rate)

  def qdisc(self) -> str:
    return _sh(["ip", "netns", "exec", self.namespaces[0], "tc", "qdisc", "show", "dev", IFACE]).stdout.strip()


@contextlib.contextmanager
def shaped_link(rate: str = "1gbit", *, subnet: int | None = None) -> Iterator[Link]:
  """Two namespaces joined by a veth pair shaped to `rate`; deleted on exit (even on failure)."""
  reason = skip_reason()
  if reason:
    raise RuntimeError(reason)
  tag = f"pjx{os.getpid()}"
  names = (f"{tag}a", f"{tag}b")
  x = subnet if subnet is not None else os.getpid() % 200 + 20
  addrs = (f"10.213.{x}.1", f"10.213.{x}.2")
  tmp = (f"{tag}x", f"{tag}y")
  try:
    for ns in names:
      delete_namespace(ns)
      _sh(["ip", "netns", "add", ns])
      _CREATED.append(ns)
      _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
    # create the pair directly inside the namespaces, so nothing lingers in the root namespace
    _sh(["ip", "-n", names[0], "link", "add", tmp[0], "type", "veth", "peer", "name", tmp[1], "netns",
         names[1]])
    for ns, t, addr in zip(names, tmp, addrs):
      _sh(["ip", "-n", ns, "link", "set", t, "name", IFACE])
      _sh(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", IFACE])
      _sh(["ip", "-n", ns, "link", "set", IFACE, "up"])
      _sh(_tbf(ns, rate))
    yield Link(names, addrs, rate)
  finally:
    for ns in names:
      delete_namespace(ns)


def run_pair(link: Link, worker_argv: Sequence[str], *, port: int,
             pin: bool = False) -> tuple[int, dict | None, float]:
  """Runs `worker_argv --result FILE` as two processes under `prophet-jax launch`, rank i inside
  `link.namespaces[i]`, gloo bound to the veth. With `pin`, rank i runs on CPU core i only
  (`taskset`), as each worker of a cluster has its own machine: the two processes then do not
  compete for cores, and one's compute cannot delay the other's network thread.

  Returns (exit code, rank 0's JSON result or None when the run failed, wall seconds).
  """
  import json
  import shlex
  import tempfile
  import time

  from prophet_jax.launch import launch

  with tempfile.TemporaryDirectory() as tmp:
    result = os.path.join(tmp, "rank0.json")
    inner = [*worker_argv, "--result", result]
    script = (f'if [ "$PROPHET_PROCESS_ID" = 0 ]; then NS={link.namespaces[0]}; else '
              f'NS={link.namespaces[1]}; fi; export PROPHET_GLOO_INTERFACE={link.iface} '
              f'PROPHET_HEARTBEAT_TIMEOUT_S=900; exec ip netns exec "$NS" '
              + ("taskset -c $PROPHET_PROCESS_ID " if pin else "")
              + " ".join(shlex.quote(a) for a in inner))
    t0 = time.perf_counter()
    code = launch(["sh", "-c", script], nproc=2, coordinator=link.addresses[0], port=port,
                  devices_per_process=1, init_timeout_s=120)
    if code or not os.path.exists(result):
      return code, None, time.perf_counter() - t0
    with open(result) as f:
      return code, json.load(f), time.perf_counter() - t0


def run_rates(rates: Sequence[str], worker_argv: Sequence[str], *, port: int, pin: bool = False,
              bench: str) -> dict:
  """For each rate: a shaped link, `worker_argv` as a pair on it (`run_pair`), and rank 0's result
  with its `wall_s`, or `{"failed": exit code}` (said on stderr, naming `bench`). Returns {rate: ...}."""
  import sys

  out: dict = {}
  for rate in rates:
    with shaped_link(rate) as link:
      print(f"== {rate}: {link.qdisc()}", flush=True)
      code, r, wall = run_pair(link, worker_argv, port=port, pin=pin)
    if r is None:
      print(f"{bench}: the run at {rate} failed (exit {code}).", file=sys.stderr)
      out[rate] = dict(failed=code)
    else:
      out[rate] = dict(r, wall_s=wall)
  return out


def write_results(results: dict, out: str, *, merge: bool) -> None:
  """Writes `results` (with a 'rates' dict) to `out` as JSON; with `merge`, keeps the rates of the
  file already there that this run did not measure (each with the command that measured it)."""
  import json
  from pathlib import Path

  path = Path(out)
  path.parent.mkdir(parents=True, exist_ok=True)
  if merge and path.exists():
    old = json.loads(path.read_text())
    for rate, r in old.get("rates", {}).items():
      results["rates"].setdefault(rate, dict(r, command=old.get("command")))
  path.write_text(json.dumps(results, indent=1))
