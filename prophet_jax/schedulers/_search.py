"""The local search of `auto`: first-improvement moves over candidate chunks, with random kicks.

Pure: numpy only, never jax. A move edits a range of chunks (merge two, swap two, split one; on small
schedules also move a chunk or one slice anywhere, or merge it into any chunk of its dtype), and is
scored by splicing the per-chunk arrays (no rebuild) and asking the numeric core. Deterministic: the
kicks draw from a fixed seed, and the number of evaluations is bounded.
"""

from __future__ import annotations

import numpy as np

from .._core import Problem
from ._joint import SearchChunk, chunk_stats, evaluate, make_chunk, merged

PATIENCE = 40   # kicks in a row without improvement before the iterated search stops


def moves(prob: Problem, cur: list[SearchChunk], k: int, rich: bool):
  """The neighbourhood of chunk k, as edits (i, j, new): replace cur[i:j] with `new`."""
  c = cur[k]
  if k + 1 < len(cur):
    if c.dtype == cur[k + 1].dtype:
      yield k, k + 2, [merged(prob, c, cur[k + 1])]
    yield k, k + 2, [cur[k + 1], c]
  s = c.slices
  if len(s) > 1:
    half = len(s) // 2
    yield k, k + 1, [make_chunk(prob, s[:half]), make_chunk(prob, s[half:])]
  if not rich:
    return
  n = len(cur)
  rest = cur[:k] + cur[k + 1:]
  for j in range(n):  # move the chunk anywhere
    if j not in (k, k + 1):
      yield 0, n, rest[:j] + [c] + rest[j:]
  for j in range(n - 1):  # merge it into any other chunk of its dtype
    if rest[j].dtype == c.dtype:
      yield 0, n, rest[:j] + [merged(prob, rest[j], c)] + rest[j + 1:]
  if len(s) > 1:  # move one slice out: alone anywhere, or into another chunk of its dtype
    for i in range(len(s)):
      alone = make_chunk(prob, [s[i]])
      base = cur[:k] + [make_chunk(prob, s[:i] + s[i + 1:])] + cur[k + 1:]
      for j in range(n + 1):
        yield 0, n, base[:j] + [alone] + base[j:]
      for j in range(n):
        if j != k and base[j].dtype == c.dtype:
          yield 0, n, base[:j] + [merged(prob, base[j], alone)] + base[j + 1:]


def local_search(prob: Problem, chunks: list[SearchChunk], budget: int,
                  rich: bool) -> tuple[list[SearchChunk], float, int]:
  """First-improvement local search over `_moves` (merge, swap, split; rich: move chunks and slices).

  A trial replaces a range of chunks, so it is scored by splicing the per-chunk arrays (no rebuild).
  Stops at a local optimum or after `budget` evaluations. Returns (chunks, predicted, evaluations).
  """
  cur = list(chunks)
  arrays = chunk_stats(cur)
  best = evaluate(prob, *arrays)
  evals = 1
  improved = True
  while improved and evals < budget:
    improved = False
    k = 0
    while k < len(cur) and evals < budget:
      for i, j, new in moves(prob, cur, k, rich):
        evals += 1
        mid = chunk_stats(new)
        trial = tuple(np.concatenate((x[:i], m, x[j:])) for x, m in zip(arrays, mid))
        v = evaluate(prob, *trial)
        if v < best * (1 - 1e-12):
          best, arrays, improved = v, trial, True
          cur = cur[:i] + new + cur[j:]
          break
        if evals >= budget:
          break
      else:
        k += 1
  return cur, best, evals


def kick(prob: Problem, cur: list[SearchChunk], rng: np.random.Generator) -> list[SearchChunk]:
  """A random move (a chunk or one slice moved elsewhere, merged into another chunk, or split off)."""
  out = list(cur)
  k = int(rng.integers(len(out)))
  c = out.pop(k)
  kind = int(rng.integers(3))
  if kind == 1 and len(c.slices) > 1:  # one slice alone, anywhere
    i = int(rng.integers(len(c.slices)))
    out.insert(k, make_chunk(prob, c.slices[:i] + c.slices[i + 1:]))
    out.insert(int(rng.integers(len(out) + 1)), make_chunk(prob, [c.slices[i]]))
    return out
  same = [j for j in range(len(out)) if out[j].dtype == c.dtype]
  if kind == 2 and same:  # merge into another chunk of its dtype
    j = same[int(rng.integers(len(same)))]
    out[j] = merged(prob, out[j], c)
    return out
  out.insert(int(rng.integers(len(out) + 1)), c)
  return out


def iterated_local_search(prob: Problem, chunks: list[SearchChunk], budget: int, rich: bool
                           ) -> tuple[list[SearchChunk], float]:
  """Local search, then (small schedules) kicks of two random moves followed by local search again,
  keeping improvements, until `budget` evaluations are spent or `PATIENCE` kicks in a row fail.
  Deterministic (fixed seed)."""
  cur, best, used = local_search(prob, chunks, budget, rich)
  if not rich:
    return cur, best
  rng = np.random.default_rng(0)
  idle = 0
  while used < budget and len(cur) > 1 and idle < PATIENCE:
    trial = kick(prob, kick(prob, cur, rng), rng)
    cand, v, n = local_search(prob, trial, max(1, budget - used), rich)
    used += n
    idle += 1
    if v < best * (1 - 1e-12):
      cur, best, idle = cand, v, 0
  return cur, best


