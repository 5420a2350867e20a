"""A small scan-over-layers model whose per-layer gradients are all-reduced inside the backward loop.

`ScanMLP` embeds its input, runs `depth` identical residual blocks with `flax.linen.scan` (their params
stacked on a leading axis, under 'params/blocks'), and classifies. Each scanned block reads its params
through `prophet_jax`'s `loop_hook` (via `nn.map_variables`), so under
`prophet_jax.hooked(loss_fn, schedule, axis_name=..., in_loop=SCAN_IN_LOOP)` the block's gradients are
all-reduced on every trip of the backward loop, as soon as that layer's weight gradients exist: a
`scheduled` optimizer or a loss-level hook can only reduce the stacked gradients after the loop ends.
Outside `hooked` the hook is the identity, so init, evaluation and a plain `jax.grad` are unaffected.

Example:
  >>> m = scan_model()
  >>> params = m.init(jax.random.key(0))
  >>> outer = {"params": {k: v for k, v in params["params"].items() if k != "blocks"}}
  >>> schedule = prophet_jax.plan(prophet_jax.GradientProfile.from_params(outer), network, "wfbp")
  >>> grad_fn = prophet_jax.hooked(m.loss_fn, schedule, axis_name="data", in_loop=SCAN_IN_LOOP)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from prophet_jax import loop_hook

__all__ = ["ScanMLP", "ScanModel", "scan_model", "SCAN_IN_LOOP", "outer_params"]

SCAN_IN_LOOP = ("params/blocks",)


class Block(nn.Module):
  """One residual tanh block: h + tanh(Dense(h))."""

  width: int

  @nn.compact
  def __call__(self, h: jax.Array, _: Any) -> tuple[jax.Array, None]:
    return h + jnp.tanh(nn.Dense(self.width, name="dense")(h)), None


def _hook_params(variables: Any) -> Any:
  return loop_hook(variables, name="blocks")


HookedBlock = nn.map_variables(Block, "params", trans_in_fn=_hook_params, init=True, mutable=False)


class ScanMLP(nn.Module):
  """Dense embed -> `depth` scanned residual blocks (hooked) -> Dense head."""

  width: int = 32
  depth: int = 4
  classes: int = 10

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    h = nn.Dense(self.width, name="embed")(x)
    blocks = nn.scan(HookedBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                     length=self.depth)
    h, _ = blocks(self.width, name="blocks")(h, None)
    return nn.Dense(self.classes, name="head")(h)


@dataclass(frozen=True)
class ScanModel:
  """The scan model and a synthetic classification task (like `prophet_jax.models.get_model`)."""

  module: ScanMLP = field(default_factory=ScanMLP)
  features: int = 16

  def init(self, rng: jax.Array) -> dict[str, Any]:
    """Variables {'params': {'embed', 'blocks' (stacked on axis 0), 'head'}}."""
    return {"params": self.module.init(rng, jnp.zeros((1, self.features)))["params"]}

  def loss_fn(self, params: Any, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean softmax cross-entropy over the batch."""
    logits = self.module.apply(params, batch["x"]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))

  def make_batch(self, rng: jax.Array, batch_size: int) -> dict[str, jax.Array]:
    """Inputs ~ N(0, 1) and labels from a fixed linear map of them (a learnable signal)."""
    x = jax.random.normal(rng, (batch_size, self.features))
    w = jax.random.normal(jax.random.key(7), (self.features, self.module.classes))
    return {"x": x, "y": jnp.argmax(x @ w, axis=1).astype(jnp.int32)}


def scan_model(*, width: int = 32, depth: int = 4, features: int = 16) -> ScanModel:
  """A ScanModel; `depth` is the number of scanned layers (trips of the backward loop)."""
  if depth < 1 or width < 1 or features < 1:
    raise ValueError(f"scan_model(width={width}, depth={depth}, features={features}): all must be >= 1.")
  return ScanModel(module=ScanMLP(width=width, depth=depth), features=features)


def outer_params(params: Any) -> Any:
  """The params outside the scanned blocks: the tree to plan the hooked schedule for."""
  return {"params": {k: v for k, v in params["params"].items() if k != "blocks"}}
