"""Canonical key paths of pytree leaves ('params/Conv_0/kernel'), shared by the profile and the rewrite.

Uses jax's flattening when jax is importable (so flax, optax and custom nodes flatten exactly as in
the step); plain dicts, lists and tuples flatten the same way without it (dict keys sorted).
"""

from __future__ import annotations

from typing import Any


def path_str(keypath: Any) -> str:
  """'params/Conv_0/kernel' for a jax key path."""
  import jax

  return jax.tree_util.keystr(tuple(keypath), simple=True, separator="/")


def flatten_with_paths(tree: Any) -> list[tuple[str, Any]]:
  """[(path, leaf)] in jax's flatten order."""
  try:
    import jax
  except ImportError:  # the pure fallback: dicts (sorted keys), lists and tuples
    out: list[tuple[str, Any]] = []

    def walk(prefix: str, node: Any) -> None:
      if isinstance(node, dict):
        for k in sorted(node):
          walk(f"{prefix}/{k}" if prefix else str(k), node[k])
      elif isinstance(node, (list, tuple)):
        for i, x in enumerate(node):
          walk(f"{prefix}/{i}" if prefix else str(i), x)
      elif node is not None:
        out.append((prefix, node))

    walk("", tree)
    return out
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [(path_str(p), leaf) for p, leaf in leaves]
