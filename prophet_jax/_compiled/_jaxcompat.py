"""The JAX prophet_jax runs on: the versions it supports and tests, and every private JAX name it reads."""

from __future__ import annotations

import functools
import importlib
from typing import Any

from .._values._errors import JaxVersionError

# the range pyproject.toml declares (jax and jaxlib alike)
SUPPORTED_JAX = ">=0.10.2,<0.13"
# the versions the whole suite passed on (make test: 0.10.2 on Python 3.11; make test-latest: the newest,
# 0.12.0.1 on Python 3.13 when this was written; 0.11.2 on Python 3.13 by hand, docs/facts.md)
TESTED_JAX_VERSIONS = ("0.10.2", "0.11.2", "0.12.0.1")

# (module, attribute path, what needs it)
PRIVATE_JAX: tuple[tuple[str, str, str], ...] = (
    ("jax._src.clusters", "ClusterEnv._cluster_types", "launch.initialize(): detecting a cluster"),
    ("jax._src.lib", "_jax.make_gloo_tcp_collectives", "--gloo-interface"),
    ("jax._src.xla_bridge", "register_backend_factory", "--gloo-interface"),
    ("jax._src.xla_bridge", "make_cpu_client", "--gloo-interface"),
    ("jax._src.xla_bridge", "backends_are_initialized", "--gloo-interface"),
    ("jax._src.distributed", "global_state", "--gloo-interface"),
    ("jax._src.xla_bridge", "_discover_and_register_pjrt_plugins", "the command line's quiet start"),
)

# public, for extensions: (module, attribute path)
JAXPR_API: tuple[tuple[str, str], ...] = (
    ("jax.extend.core", "Literal"),
    ("jax.extend.core", "Jaxpr.replace"),
    ("jax.extend.core", "JaxprEqn.replace"),
    ("jax.extend.core", "ClosedJaxpr"),
    ("jax.extend.core", "jaxpr_as_fun"),
    ("jax.extend.core", "Var"),
    ("jax.extend.core", "DebugInfo"),
)
# what the code reads from a traced jaxpr and its equations
_JAXPR_FIELDS = ("jaxpr", "consts", "eqns", "invars", "outvars", "constvars", "effects", "debug_info")
_EQN_FIELDS = ("primitive", "params", "invars", "outvars", "effects")


def _installed() -> str:
  try:
    import jax  # lazy: a pure module

    return jax.__version__
  except ImportError:
    return "(none)"


def _advice(fix: str) -> str:
  return (f"prophet_jax supports jax {SUPPORTED_JAX} and was tested with jax "
          f"{', '.join(TESTED_JAX_VERSIONS)}: install one of those (pip install 'jax=={TESTED_JAX_VERSIONS[-1]}' "
          f"'jaxlib=={TESTED_JAX_VERSIONS[-1]}'){'; or ' + fix if fix else ''}.")


def private(module: str, attribute: str, *, feature: str, error: type[Exception] = JaxVersionError,
            fix: str = "") -> Any:
  """`module.attribute` (dotted), one of `PRIVATE_JAX`, or `error` naming it, `feature`, the jax and `fix`.

  Raises:
    AssertionError: the name is not listed in PRIVATE_JAX (the inventory must be complete).
  """
  if not any(m == module and a == attribute for m, a, _ in PRIVATE_JAX):
    raise AssertionError(f"prophet_jax internal error: {module}.{attribute} is not in PRIVATE_JAX.")
  try:
    return _resolve(module, attribute)
  except (ImportError, AttributeError) as e:
    raise error(f"{feature} needs jax's private {module}.{attribute}, which jax {_installed()} does not "
                f"have ({type(e).__name__}: {e}). {_advice(fix)}") from e


def _resolve(module: str, attribute: str) -> Any:
  obj: Any = importlib.import_module(module)
  for part in attribute.split("."):
    obj = getattr(obj, part)
  return obj


@functools.lru_cache(maxsize=None)
def _jaxpr_api_missing() -> tuple[str, ...]:
  missing = []
  for module, attribute in JAXPR_API:
    try:
      _resolve(module, attribute)
    except (ImportError, AttributeError):
      missing.append(f"{module}.{attribute}")
  if missing:
    return tuple(missing)
  import jax  # lazy: a pure module

  closed = jax.make_jaxpr(lambda x: jax.jit(lambda y: y * 2)(x) + 1)(1.0)
  missing += [f"a traced jaxpr's .{f}" for f in _JAXPR_FIELDS if not hasattr(closed, f)
              and not hasattr(getattr(closed, "jaxpr", None), f)]
  eqn = closed.jaxpr.eqns[0] if hasattr(closed, "jaxpr") and getattr(closed.jaxpr, "eqns", None) else None
  missing += [f"a jaxpr equation's .{f}" for f in _EQN_FIELDS if eqn is not None and not hasattr(eqn, f)]
  if eqn is not None and "jaxpr" not in getattr(eqn, "params", {}):
    missing.append("a nested jit equation's params['jaxpr']")
  return tuple(missing)


def check_jaxpr_api(feature: str) -> None:
  """Raises JaxVersionError naming each `jax.extend.core` name or jaxpr field `feature` reads that jax lacks."""
  missing = _jaxpr_api_missing()
  if missing:
    raise JaxVersionError(f"{feature} reads jaxprs through jax.extend.core, and jax {_installed()} lacks "
                          f"{', '.join(missing)}. {_advice('')}")


def scan_parts(eqn: Any) -> tuple[int, int]:
  """(consts, carries) of a scan equation's operands (jax 0.10: `num_consts`/`num_carry`; 0.12: the
  `ft_in` tree of (consts, carry, xs))."""
  p = eqn.params
  if "num_consts" in p:
    return int(p["num_consts"]), int(p["num_carry"])
  consts, carry, _ = p["ft_in"].update(list(range(len(eqn.invars)))).unpack()
  return len(list(consts)), len(list(carry))
