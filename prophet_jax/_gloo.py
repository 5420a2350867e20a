"""Binding gloo (jax's CPU collectives) to one network interface: the ONE private call, isolated here.

Why: gloo finds its own address by resolving the hostname, which here (and in network namespaces)
is 127.0.0.1, so two processes on two hosts, or two namespaces joined by a veth pair, cannot reach
each other. jax 0.10 exposes no public option for the interface; its CPU client is built by
`jax._src.xla_bridge.make_cpu_client`, which calls the private
`jax._src.lib._jax.make_gloo_tcp_collectives(distributed_client, hostname=None, interface=None)`.
`bind_gloo_interface` builds those collectives with `interface=` and registers a CPU backend factory
that uses them. It must run after `jax.distributed.initialize` and before the first jax operation
(which starts the backend). Every private name used is checked first, with a clear error when a jax
upgrade removed it.
"""

from __future__ import annotations

import functools
import socket
import warnings

TESTED_JAX_VERSIONS = ("0.10.2",)


class GlooBindError(RuntimeError):
  """The private jax call that binds gloo to an interface is unavailable or came too late."""


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
  """Makes jax's CPU backend use gloo collectives bound to `interface`.

  Args:
    interface: a network interface name of this host or namespace, e.g. 'veth0'.

  Raises:
    ValueError: the interface does not exist here.
    GlooBindError: jax.distributed is not initialized yet, the CPU backend has already started, or
      this jax lacks the private call (pin jax to one of TESTED_JAX_VERSIONS, or drop the interface
      option and let gloo resolve the hostname).
  """
  check_interface(interface)
  import jax

  try:
    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax
    make = _jax.make_gloo_tcp_collectives
    register = xla_bridge.register_backend_factory
    make_cpu_client = xla_bridge.make_cpu_client
    started = xla_bridge.backends_are_initialized
  except (ImportError, AttributeError) as e:
    raise GlooBindError(
        f"jax {jax.__version__} lacks the private call prophet_jax uses to bind gloo to an interface "
        f"({e}); it was tested with jax {', '.join(TESTED_JAX_VERSIONS)}. Install one of those, or run "
        f"without --gloo-interface.") from e
  if "interface" not in (make.__doc__ or ""):
    raise GlooBindError(f"jax {jax.__version__}: make_gloo_tcp_collectives takes no `interface` "
                        f"argument any more; tested with jax {', '.join(TESTED_JAX_VERSIONS)}.")
  if jax.__version__ not in TESTED_JAX_VERSIONS:
    warnings.warn(f"binding gloo to {interface!r} through a private jax call tested only with jax "
                  f"{', '.join(TESTED_JAX_VERSIONS)}; this is jax {jax.__version__}.", stacklevel=2)
  client = distributed.global_state.client
  if client is None:
    raise GlooBindError("bind_gloo_interface() needs jax.distributed.initialize() first (gloo "
                        "rendezvous goes through the distributed client).")
  if started():
    raise GlooBindError(f"the jax backend has already started, so gloo can no longer be bound to "
                        f"{interface!r}: call prophet_jax.launch.initialize() before any jax "
                        f"operation (jax.devices(), jnp arrays, jit).")
  collectives = make(distributed_client=client, interface=interface)
  register("cpu", functools.partial(make_cpu_client, collectives=collectives), priority=0,
           fail_quietly=False)
