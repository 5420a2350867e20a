"""The oracle every rewrite is tested against, written once: N plain steps on one device with the full
batch (no all-reduce), `tx` applied to `jax.grad` of the loss."""

from __future__ import annotations

import jax
import optax


def full_batch(loss_fn, params, tx, batches) -> tuple:
  """(final params on the host, [loss of each step]) of the single-device loop over `batches`."""

  @jax.jit
  def step(p, o, b):
    loss, g = jax.value_and_grad(loss_fn)(p, b)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o, loss

  p, o, losses = params, tx.init(params), []
  for b in batches:
    p, o, loss = step(p, o, b)
    losses.append(float(loss))
  return jax.device_get(p), losses
