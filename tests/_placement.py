"""The placement harness of the pipelined tests: 8 devices on one axis, "data", as a mesh (shard_map) or
laid out the way pmap lays out its own outputs (so inputs already placed this way do not recompile)."""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "data"
NDEV = 8


@functools.cache
def mesh():
  return jax.make_mesh((NDEV,), (AXIS,))


@functools.cache
def pmap_sharding():
  # pmap's own output sharding: inputs already laid out this way do not make pmap compile again
  return NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:NDEV]), (AXIS,)), P(AXIS))


def shard(x):
  """Global batch (B, ...) -> (NDEV, B / NDEV, ...), laid out for pmap."""
  x = jax.tree.map(lambda a: np.asarray(a).reshape(NDEV, a.shape[0] // NDEV, *a.shape[1:]), x)
  return jax.device_put(x, pmap_sharding())


def replicate(tree):
  # on the host (numpy): an eager jnp op per leaf shape would compile a small program each
  return jax.device_put(jax.tree.map(lambda a: np.broadcast_to(np.asarray(a), (NDEV, *np.shape(a))), tree),
                        pmap_sharding())


def unrep(tree):
  return jax.tree.map(lambda a: np.asarray(a)[0], tree)


def put(tree, spec):
  return jax.device_put(tree, NamedSharding(mesh(), spec))
