"""The PROPHET_* environment flags, read and checked once, only by `cli.py` and `launch.py` (pure;
docs/design.md, "Environment variables").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

PREFIX = "PROPHET_"
FLAGS: tuple[str, ...] = (
    "PROPHET_PROCESS_ID", "PROPHET_NUM_PROCESSES", "PROPHET_COORDINATOR", "PROPHET_GLOO_INTERFACE",
    "PROPHET_INIT_TIMEOUT_S", "PROPHET_HEARTBEAT_TIMEOUT_S", "PROPHET_LOCAL_DEVICES", "PROPHET_DEBUG",
)
DEFAULT_INIT_TIMEOUT_S = 60
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
  """The checked PROPHET_* flags, one field per flag, None where unset (docs/design.md, "Environment
  variables").
  """

  process_id: int | None = None
  num_processes: int | None = None
  coordinator: str | None = None
  gloo_interface: str | None = None
  init_timeout_s: int = DEFAULT_INIT_TIMEOUT_S
  heartbeat_timeout_s: int | None = None
  local_devices: int | None = None
  debug: bool = False

  @property
  def launched(self) -> bool:
    """True when this process was started by `prophet_jax.launch` (the process flags are set)."""
    return self.num_processes is not None


def _int(name: str, text: str, *, minimum: int) -> int:
  try:
    value = int(text.strip())
  except ValueError:
    raise ValueError(f"{name}={text!r} is not an integer; set it to an integer >= {minimum} "
                     f"(or unset it).") from None
  if value < minimum:
    raise ValueError(f"{name}={text!r} is below {minimum}; set it to an integer >= {minimum} "
                     f"(or unset it).")
  return value


def read_config(environ: Mapping[str, str]) -> Config:
  """The checked PROPHET_* flags of `environ`; ValueError naming a bad or unknown one."""
  unknown = sorted(k for k in environ if k.startswith(PREFIX) and k not in FLAGS)
  if unknown:
    raise ValueError(f"unknown environment variable(s) {unknown}; prophet_jax reads only {list(FLAGS)}. "
                     f"Unset the unknown ones (a typo?).")
  trio = ("PROPHET_PROCESS_ID", "PROPHET_NUM_PROCESSES", "PROPHET_COORDINATOR")
  present = [k for k in trio if environ.get(k) not in (None, "")]
  if present and len(present) != len(trio):
    raise ValueError(f"{present} set but {[k for k in trio if k not in present]} not: the process flags come "
                     f"together (launch sets all three). Set the missing ones or unset them all.")
  kw: dict = {}
  if present:
    nproc = _int("PROPHET_NUM_PROCESSES", environ.get("PROPHET_NUM_PROCESSES"), minimum=1)
    pid = _int("PROPHET_PROCESS_ID", environ.get("PROPHET_PROCESS_ID"), minimum=0)
    if pid >= nproc:
      raise ValueError(f"PROPHET_PROCESS_ID={pid} but PROPHET_NUM_PROCESSES={nproc}; the id must be "
                       f"in [0, {nproc - 1}].")
    coord = environ.get("PROPHET_COORDINATOR").strip()
    host, sep, port = coord.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise ValueError(f"PROPHET_COORDINATOR={coord!r} is not 'host:port' (e.g. '127.0.0.1:12345').")
    kw.update(process_id=pid, num_processes=nproc, coordinator=coord)
  iface = (environ.get("PROPHET_GLOO_INTERFACE") or "").strip()
  if iface:
    if any(c.isspace() or c == "/" for c in iface) or len(iface) > 15:
      raise ValueError(f"PROPHET_GLOO_INTERFACE={iface!r} is not a network interface name (at most 15 "
                       f"characters, no spaces or '/'), e.g. 'eth0' or 'veth0'.")
    kw["gloo_interface"] = iface
  for field in ("init_timeout_s", "heartbeat_timeout_s", "local_devices"):   # the flags of integers >= 1
    flag = PREFIX + field.upper()
    if environ.get(flag) not in (None, ""):
      kw[field] = _int(flag, environ.get(flag), minimum=1)
  debug = (environ.get("PROPHET_DEBUG") or "").strip().lower()
  if debug not in _TRUE + _FALSE:
    raise ValueError(f"PROPHET_DEBUG={debug!r}; expected one of {list(_TRUE + _FALSE[:-1])} (or empty).")
  kw["debug"] = debug in _TRUE
  return Config(**kw)


def nvidia_driver_present(root: str = "/") -> bool:
  """Whether an NVIDIA kernel driver is visible (/proc/driver/nvidia or /dev/nvidiactl exists)."""
  return any(os.path.exists(os.path.join(root, p)) for p in ("proc/driver/nvidia", "dev/nvidiactl"))


def default_jax_platforms(environ: Mapping[str, str], *, cuda_plugin: bool,
                          nvidia_driver: bool) -> str | None:
  """'cpu' when the command line should set JAX_PLATFORMS=cpu before jax starts (unset JAX_PLATFORMS, a
  CUDA plugin, no NVIDIA driver), else None.
  """
  return None if "JAX_PLATFORMS" in environ or not cuda_plugin or nvidia_driver else "cpu"


_CACHE: dict[str, Config] = {}


def config() -> Config:
  """The process's flags, read from os.environ on the first call and kept (checked once)."""
  if "value" not in _CACHE:
    _CACHE["value"] = read_config(os.environ)
  return _CACHE["value"]
