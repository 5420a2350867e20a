"""The engine's sharded half: reduce-scatters and all-gathers of a sharded schedule's chunks (ZeRO-1),
one tie chain, each under its named scope; the chunks' flat, zero-padded buffers and this device's shards."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ._collectives import AG_PREFIX, RS_PREFIX, chunk_buffer, engine_divisor, scatter_chunks, tie
from ._keys import unit_scope
from .._values._schedule import Schedule, shard_size

def rs_scope(k: int) -> str:
  """The named scope of chunk k's reduce-scatter in a sharded schedule: 'prophet/rs<k>' (`audit`)."""
  return f"{RS_PREFIX}{k}"


def ag_scope(g: int) -> str:
  """The named scope of all-gather g (`schedule.gathers[g]`): 'prophet/ag<g>' (`audit`)."""
  return f"{AG_PREFIX}{g}"


def padded(buf: jax.Array, n: int) -> jax.Array:
  """`buf` zero-padded at its end to n x `shard_size(len, n)` elements (the reduce-scatter's buffer)."""
  extra = n * shard_size(buf.shape[0], n) - buf.shape[0]
  return buf if not extra else jnp.pad(buf, (0, extra))


def reduce_scatter_chunks(flat: Sequence[jax.Array], chunks: Sequence[Any], row_leaf: Sequence[int],
                          axis_name: Any, *, n: int, divisor: int | None, first_index: int = 0,
                          prev: jax.Array | None = None) -> tuple[tuple[jax.Array, ...], jax.Array | None]:
  """One reduce-scatter per chunk, in issue order: each chunk's slices in one flat buffer zero-padded to a
  multiple of `n` (`shard_size`), tied to the chain's previous result, reduce-scattered (device i gets
  elements [i*s, (i+1)*s)) under `prophet/rs<k>` and divided by `divisor` unless None.

  Returns:
    (this device's shard of every chunk, in chunk order; the last result).
  """
  divisor, seen = engine_divisor(divisor)
  shards = []
  for k, chunk in enumerate(chunks, start=first_index):
    buf = chunk_buffer(flat, chunk, row_leaf)
    if seen is not None:
      seen(k, buf)
    with unit_scope(rs_scope(k)):
      red = jax.lax.psum_scatter(tie(padded(buf, n), prev), axis_name, scatter_dimension=0, tiled=True)
      if divisor is not None:
        red = red / jnp.asarray(divisor, red.dtype)
    shards.append(red)
    prev = red
  return tuple(shards), prev


def all_gather_chunks(shards: Sequence[jax.Array], chunks: Sequence[Any], gathers: Sequence[Sequence[int]],
                      axis_name: Any, *, n: int, vma: bool, prev: jax.Array | None = None
                      ) -> tuple[list[jax.Array], jax.Array | None]:
  """One all-gather per entry of `gathers`, in order: the other half of the sharded engine.

  All-gather g concatenates this device's shards of its chunks (`shards[k]`, `shard_size` elements
  each), `tie`s the buffer to the chain's previous result and all-gathers it (tiled) under
  `jax.named_scope("prophet/ag<g>")`; each chunk's whole buffer is then read back from the result
  (device i's part holds its shard of every chunk of the gather, in order) and its padding dropped.
  Under shard_map with check_vma (`vma`) the result is typed invariant (the same on every device).

  Returns:
    (every chunk's whole buffer, `chunk.size` elements, in chunk order; the last result).
  """
  out: list[Any] = [None] * len(chunks)
  for g, ks in enumerate(gathers):
    sizes = [shard_size(chunks[k].size, n) for k in ks]
    buf = shards[ks[0]] if len(ks) == 1 else jnp.concatenate([shards[k] for k in ks])
    with unit_scope(ag_scope(g)):
      prev = jax.lax.all_gather(tie(buf, prev), axis_name, axis=0, tiled=True,
                                **({"to": "invarying"} if vma else {}))
    rows = prev.reshape(n, sum(sizes))
    for k, s, off in zip(ks, sizes, itertools.accumulate(sizes, initial=0)):
      out[k] = rows[:, off:off + s].reshape(-1)[:chunks[k].size]
  return out, prev


def local_shards(flat: Sequence[jax.Array], chunks: Sequence[Any], row_leaf: Sequence[int], axis_name: Any,
                 n: int) -> tuple[jax.Array, ...]:
  """This device's shard of every chunk's (padded) flat buffer of `flat`: elements [i*s, (i+1)*s), i
  the device's index on the axis, s = `shard_size` (what its reduce-scatter leaves it). Used for the
  parameters a ZeRO-1 update reads (weight decay)."""
  i = jax.lax.axis_index(axis_name)
  return tuple(jax.lax.dynamic_index_in_dim(padded(chunk_buffer(flat, c, row_leaf), n).reshape(n, -1), i, 0, False)
               for c in chunks)


def shards_square_sum(shards: Sequence[jax.Array], axis_name: Any, scope: str) -> tuple[jax.Array, jax.Array]:
  """(this device's sum of squares of `shards` in float32, the sum over the axis: one `psum` labelled
  `scope`): the global norm a ZeRO-1 update's global-norm transformation reads."""
  local = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in shards)
  with jax.named_scope(scope):
    return local, jax.lax.psum(local, axis_name)


def sharded_allreduce(flat: Sequence[jax.Array], schedule: Schedule, row_leaf: Sequence[int], axis_name: Any,
                      *, n: int, divisor: int | None, vma: bool) -> list[jax.Array]:
  """A sharded schedule carried out as an all-reduce: every chunk's reduce-scatter, then every
  all-gather (one tie chain), the whole buffers scattered back (replicated)."""
  chunks = schedule.chunks
  shards, last = reduce_scatter_chunks(flat, chunks, row_leaf, axis_name, n=n, divisor=divisor)
  bufs, _ = all_gather_chunks(shards, chunks, schedule.gathers, axis_name, n=n, vma=vma, prev=last)
  return scatter_chunks(flat, chunks, row_leaf, bufs)
