"""The host-side oracle of DLCP's deferral (numpy): exactly what a deferring step computes.

docs/design.md ("Deferral in the rewrite (DLCP)") and prophet_jax/_rewrite/_defer.py state the
semantics; this is an independent numpy implementation of them, used to check the jitted step (and, in
bench/dlcp.py, to drop the error
feedback). Per group and step: rows (n devices, m, c) = the chunks, zero-padded, plus each device's
residual at the chunks it deferred last step; rank by (deferred last step first, then non-finite
norms, then norm descending, ties by index); the first m - k ranks are summed over the devices and
divided by n; the last k ranks contribute zero and become the residual. With `Bucket.release` r < 1
(damped feedback) the residual has a row per chunk: a sent chunk carries its values plus r of its
row and keeps (1 - r) of it; a deferred chunk's row becomes its values plus its whole row.
"""

from __future__ import annotations

import numpy as np


class RefDefer:
  """The deferral state of every group of `schedule`, for n devices, on the host."""

  def __init__(self, schedule, n: int):
    self.schedule, self.n = schedule, n
    self.groups = []
    for b in schedule.buckets:
      if b.defer:
        m = len(b.chunks)
        rows = b.defer if b.release == 1 else m
        self.groups.append(dict(bucket=b, m=m, k=b.defer, c=b.slot_size, r=b.release,
                                norms=np.zeros(m, np.float32), deferred=np.zeros(m, bool),
                                index=np.arange(m - rows, m),
                                residual=np.zeros((n, rows, b.slot_size), np.float64)))
    self.history = []  # the chunks deferred at each step, per group

  @staticmethod
  def order(norms: np.ndarray, deferred: np.ndarray) -> np.ndarray:
    big = np.finfo(np.float32).max
    score = np.where(deferred, np.inf, np.where(np.isfinite(norms), norms, big))
    return np.argsort(-score, kind="stable")

  def step(self, flat_dev: list[np.ndarray], *, feedback: bool = True, dtype=np.float32) -> list[np.ndarray]:
    """One step: `flat_dev[row]` is (n, *shape) per-device gradients of each schedule row; returns
    the reduced (mean) rows, each (*shape)."""
    n = self.n
    sizes = [int(np.prod(s)) for _, s, _ in self.schedule.rows]
    out = [np.zeros(sz, np.float64) for sz in sizes]
    flat = [np.asarray(x, np.float64).reshape(n, -1) for x in flat_dev]
    gi = 0
    deferred_now = []
    for b in self.schedule.buckets:
      if not b.defer:
        for c in b.chunks:
          for r, a, e in c.slices:
            out[r][a:e] = (flat[r][:, a:e].sum(0) / n).astype(dtype)
        continue
      g = self.groups[gi]
      gi += 1
      m, k, cs = g["m"], g["k"], g["c"]
      rows = np.zeros((n, m, cs))
      for i, c in enumerate(b.chunks):
        rows[:, i, :c.size] = np.concatenate([flat[r][:, a:e] for r, a, e in c.slices], axis=1)
      order = self.order(g["norms"], g["deferred"])
      send, wait = order[:m - k], order[m - k:]
      res = g["residual"] if feedback else np.zeros_like(g["residual"])
      if g["r"] == 1:
        rows[:, g["index"], :] += res
        picks, kept, index = rows, rows[:, wait, :].copy(), wait
      else:
        picks = rows + g["r"] * res
        kept = res * (1 - g["r"])
        kept[:, wait, :] = rows[:, wait, :] + res[:, wait, :]
        index = g["index"]
      red = (picks[:, send, :].sum(0) / n).astype(dtype)
      g["norms"][send] = np.sqrt(np.sum(red.astype(np.float32) ** 2, axis=1, dtype=np.float32))
      g["deferred"] = np.zeros(m, bool)
      g["deferred"][wait] = True
      g["index"] = index
      g["residual"] = kept
      deferred_now.append(tuple(int(x) for x in wait))
      full = np.zeros((m, cs))
      full[send] = red
      for i, c in enumerate(b.chunks):
        off = 0
        for r, a, e in c.slices:
          out[r][a:e] = full[i, off:off + e - a]
          off += e - a
    self.history.append(deferred_now)
    return [o.reshape(s) for o, (_, s, _) in zip(out, self.schedule.rows)]

  def residual_rows(self) -> list[np.ndarray]:
    """The residuals scattered back to their elements, summed over the devices (the sum not yet sent)."""
    sizes = [int(np.prod(s)) for _, s, _ in self.schedule.rows]
    out = [np.zeros(sz) for sz in sizes]
    for g in self.groups:
      chunks = g["bucket"].chunks
      for j, i in enumerate(g["index"]):
        vals = g["residual"][:, j, :].sum(0)
        off = 0
        for r, a, e in chunks[int(i)].slices:
          out[r][a:e] += vals[off:off + e - a]
          off += e - a
    return [o.reshape(s) for o, (_, s, _) in zip(out, self.schedule.rows)]
