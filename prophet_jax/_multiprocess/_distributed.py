"""Joining a multi-process run: `jax.distributed`, and gloo bound to one interface (docs/design.md)."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import sys
import threading
import time
import warnings

from .._values._config import config
from .._values._errors import GlooBindError, LaunchError
from .._compiled._jaxcompat import TESTED_JAX_VERSIONS, private

_CLUSTER = "prophet_jax.launch.initialize() (detecting a SLURM, Open MPI, Kubernetes or Cloud TPU cluster)"
_CLUSTER_FIX = ("call jax.distributed.initialize(...) yourself before any other jax call (initialize() then "
                "sees it initialized), or set JAX_COORDINATOR_ADDRESS")


def _cluster_detected() -> bool:
  """Whether jax's cluster detection finds a cluster; LaunchError (never a silent False) where jax moved it."""
  if os.environ.get("JAX_COORDINATOR_ADDRESS"):
    return True
  types = private("jax._src.clusters", "ClusterEnv._cluster_types", feature=_CLUSTER, error=LaunchError,
                  fix=_CLUSTER_FIX)
  try:
    return any(not env.opt_in_only_method and env.is_env_present() for env in types)
  except AttributeError as e:
    import jax  # lazy: `launch` (pure) imports this module

    raise LaunchError(f"{_CLUSTER} reads jax's private jax._src.clusters.ClusterEnv entries, whose shape "
                      f"changed in jax {jax.__version__} ({e}); prophet_jax was tested with jax "
                      f"{', '.join(TESTED_JAX_VERSIONS)}. Install one of those, or {_CLUSTER_FIX}.") from e


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
  """Joins the run this process belongs to (under `launch` or on a cluster); call it before any jax call.

  Args:
    timeout_s: seconds to wait for the other processes; default PROPHET_INIT_TIMEOUT_S, else 60.

  Returns:
    True when jax.distributed is initialized (now or before), False for a single process.

  Raises:
    LaunchError: the coordinator was not reachable in time (names the address and the rank).
    ValueError: malformed PROPHET_* variables (names the variable).

  Example:
    >>> prophet_jax.launch.initialize()  # doctest: +SKIP
  """
  import jax  # lazy: `launch` (pure) imports this module

  cfg = config()
  if jax.distributed.is_initialized():
    return True
  timeout = int(timeout_s if timeout_s is not None else cfg.init_timeout_s)
  if not cfg.launched:
    if not _cluster_detected():
      return False
    jax.distributed.initialize(initialization_timeout=timeout)
    return True
  where = f"rank {cfg.process_id} of {cfg.num_processes}, coordinator {cfg.coordinator}, timeout {timeout} s"
  if cfg.process_id != 0:
    _wait_for_coordinator(cfg.coordinator, time.monotonic() + timeout, where)
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
    with contextlib.suppress(Exception):
      jax.distributed.shutdown()
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise LaunchError(
        f"jax.distributed could not connect ({where}): {first[:300]}. Is rank 0 running, and is "
        f"{cfg.coordinator} reachable from this process? Start all ranks with `prophet-jax launch` or "
        f"raise PROPHET_INIT_TIMEOUT_S.") from e
  finally:
    watchdog.cancel()
  if cfg.gloo_interface:
    bind_gloo_interface(cfg.gloo_interface)
  return True


# --------------------------------------------------------------------------------------------------
# gloo on one interface


def check_interface(interface: str) -> None:
  """Raises ValueError when `interface` is not a network interface of this host (or namespace)."""
  if not isinstance(interface, str) or not interface:
    raise ValueError(f"gloo_interface={interface!r}: give a network interface name such as 'eth0'.")
  try:
    socket.if_nametoindex(interface)
  except OSError:
    names = sorted(name for _, name in socket.if_nameindex())
    raise ValueError(f"gloo_interface={interface!r} is not a network interface here; this host (or "
                     f"network namespace) has {names}.") from None


def bind_gloo_interface(interface: str) -> None:
  """Makes jax's CPU backend use gloo collectives bound to `interface` (e.g. 'veth0').

  Raises:
    ValueError: the interface does not exist here.
    GlooBindError: jax.distributed is not initialized yet, the CPU backend has already started, or this
      jax lacks the private call.
  """
  check_interface(interface)
  import jax  # lazy: `launch` (pure) imports this module

  get = functools.partial(private, feature="--gloo-interface", error=GlooBindError,
                          fix="run without --gloo-interface (gloo then resolves the hostname)")
  make = get("jax._src.lib", "_jax.make_gloo_tcp_collectives")
  register = get("jax._src.xla_bridge", "register_backend_factory")
  make_cpu_client = get("jax._src.xla_bridge", "make_cpu_client")
  started = get("jax._src.xla_bridge", "backends_are_initialized")
  global_state = get("jax._src.distributed", "global_state")
  if "interface" not in (make.__doc__ or ""):
    raise GlooBindError(f"jax {jax.__version__}: make_gloo_tcp_collectives takes no `interface` "
                        f"argument any more; tested with jax {', '.join(TESTED_JAX_VERSIONS)}.")
  if jax.__version__ not in TESTED_JAX_VERSIONS:
    warnings.warn(f"binding gloo to {interface!r} through a private jax call tested only with jax "
                  f"{', '.join(TESTED_JAX_VERSIONS)}; this is jax {jax.__version__}.", stacklevel=2)
  client = global_state.client
  if client is None:
    raise GlooBindError("bind_gloo_interface() needs jax.distributed.initialize() first (gloo "
                        "rendezvous goes through the distributed client).")
  if started():
    raise GlooBindError(f"the jax backend has already started, so gloo can no longer be bound to {interface!r}: call "
                        "prophet_jax.launch.initialize() before any jax operation (jax.devices(), jnp arrays, jit).")
  register("cpu", functools.partial(make_cpu_client, collectives=make(distributed_client=client, interface=interface)),
           priority=0, fail_quietly=False)
