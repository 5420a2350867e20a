"""Small trainable flax models for tests, profiling and the demo: `mlp`, `cnn`, `gpt-tiny`, `resnet-small`.

Each model is a `TrainableModel`: `init(rng)` gives the variables dict `{'params': {...}}` (so leaf paths
are the canonical `params/Dense_0/kernel` of docs/design.md and the dict goes straight to `module.apply`),
`loss_fn(params, batch)` is the MEAN loss over the batch (a per-device mean followed by `pmean` equals
the global mean when every device holds the same number of examples), and `make_batch(rng, batch_size)`
draws a synthetic batch, deterministic in `rng`, with a fixed learnable signal so the loss falls.

The models are small (10k-80k parameters) so the test suite can compile each several times on two CPU
cores, but deep enough to have several layers (and the `mlp` has 12 Dense layers, so flax's sorted
dict keys put `Dense_10` before `Dense_2`: use `forward_paths` for forward order).

Examples:
  >>> import jax
  >>> from prophet_jax.models import get_model
  >>> m = get_model("mlp")
  >>> params = m.init(jax.random.key(0))
  >>> batch = m.make_batch(jax.random.key(1), m.default_batch_size)
  >>> float(m.loss_fn(params, batch)) > 0
  True
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import flax.linen as nn

from prophet_jax._compiled._jaxpr import forward_paths
from prophet_jax._values._tree import is_reduced_leaf, layer_of
from prophet_jax._values._checks import check_int

__all__ = ["MODELS", "PARAM_DTYPES", "TrainableModel", "get_model", "layer_of", "forward_paths",
           "num_params"]

PARAM_DTYPES = ("float32", "bfloat16")
NUM_CLASSES = 10
# init and make_batch run once per shape but compile slowly on the CPU (random-bit generation unrolls
# into large programs): skip LLVM's expensive optimisations for them (about 2x faster to compile).
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


class _FastJit:
  """`jax.jit(fn)` compiled with `_FAST_COMPILE` when called with concrete arrays (one executable per
  input signature); inside a trace (jit, eval_shape, pmap, grad) a plain call, since compiler options
  are only allowed on a top-level jit. Trailing `static` positional arguments are Python values."""

  def __init__(self, fn: Callable[..., Any], static: int = 0):
    self._fn, self._static = fn, static
    self._jit = jax.jit(fn, static_argnums=tuple(range(fn.__code__.co_argcount - static,
                                                       fn.__code__.co_argcount)))
    self._compiled: dict[Any, Any] = {}

  def __call__(self, *args):
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(args)):
      return self._fn(*args)
    dyn = args[:len(args) - self._static]
    key = (tuple((str(jax.typeof(x)), getattr(x, "sharding", None)) for x in jax.tree_util.tree_leaves(dyn)),
           args[len(args) - self._static:])
    if key not in self._compiled:
      self._compiled[key] = self._jit.lower(*args).compile(compiler_options=_FAST_COMPILE)
    return self._compiled[key](*dyn)
_SIGNAL_SEED = 1234  # fixed seed of each task's class templates / token map (the learnable signal)


# --------------------------------------------------------------------------------------------------
# Helpers shared with the rest of the project


def num_params(tree: Any) -> int:
  """Total number of elements of the floating-point leaves of a pytree (arrays or ShapeDtypeStructs)."""
  return int(sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(tree) if is_reduced_leaf(x)))


# --------------------------------------------------------------------------------------------------
# Modules


class MLP(nn.Module):
  """12 Dense layers: input projection, 10 residual hidden layers, classifier."""

  width: int = 32
  hidden_layers: int = 10
  num_classes: int = NUM_CLASSES
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(self.width, dtype=self.dtype)(x))
    # residual branches start small (variance 1/hidden_layers) so 10 of them do not blow up the scale
    init = nn.initializers.variance_scaling(1.0 / self.hidden_layers, "fan_in", "truncated_normal")
    for _ in range(self.hidden_layers):
      h = h + nn.relu(nn.Dense(self.width, dtype=self.dtype, kernel_init=init)(h))
    return nn.Dense(self.num_classes, dtype=self.dtype)(h)


class CNN(nn.Module):
  """Four 3x3 convolutions (two with stride 2), global average pooling, two Dense layers."""

  num_classes: int = NUM_CLASSES
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    for feat, stride in ((16, 1), (16, 2), (32, 1), (32, 2)):
      x = nn.relu(nn.Conv(feat, (3, 3), strides=(stride, stride), dtype=self.dtype)(x))
    x = jnp.mean(x, axis=(1, 2))
    x = nn.relu(nn.Dense(64, dtype=self.dtype)(x))
    return nn.Dense(self.num_classes, dtype=self.dtype)(x)


class ResidualBlock(nn.Module):
  """Basic ResNet block (two 3x3 convs) with GroupNorm; a 1x1 projection when the shape changes."""

  features: int
  stride: int = 1
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    groups = min(8, self.features)
    y = nn.Conv(self.features, (3, 3), strides=(self.stride, self.stride), use_bias=False,
                dtype=self.dtype)(x)
    y = nn.relu(nn.GroupNorm(num_groups=groups, dtype=self.dtype)(y))
    y = nn.Conv(self.features, (3, 3), use_bias=False, dtype=self.dtype)(y)
    y = nn.GroupNorm(num_groups=groups, dtype=self.dtype)(y)
    if x.shape[-1] != self.features or self.stride != 1:
      x = nn.Conv(self.features, (1, 1), strides=(self.stride, self.stride), use_bias=False,
                  dtype=self.dtype, name="proj")(x)
    return nn.relu(x + y)


class ResNetSmall(nn.Module):
  """A small ResNet: 3x3 stem, three stages of one basic block (16, 32, 64 channels), pooling, Dense.

  Normalisation is GroupNorm, not BatchNorm, on purpose: BatchNorm normalises with statistics of the
  batch a device sees, so a data-parallel step (statistics of each device's shard) computes a different
  function from the single-device full-batch step, and its running averages are extra non-gradient
  state. GroupNorm's statistics are per example, so the data-parallel step equals the full-batch step
  up to float summation order, which is what the equivalence tests require.
  """

  num_classes: int = NUM_CLASSES
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(16, (3, 3), use_bias=False, dtype=self.dtype, name="stem")(x)
    x = nn.relu(nn.GroupNorm(num_groups=8, dtype=self.dtype, name="stem_norm")(x))
    for i, (feat, stride) in enumerate(((16, 1), (32, 2), (64, 2))):
      x = ResidualBlock(feat, stride, dtype=self.dtype, name=f"stage{i + 1}")(x)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x)


class Block(nn.Module):
  """Pre-LayerNorm transformer block: causal self-attention and a 4x MLP."""

  d_model: int
  num_heads: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    t = x.shape[1]
    mask = nn.make_causal_mask(jnp.ones((x.shape[0], t), jnp.int32))
    h = nn.LayerNorm(dtype=self.dtype, name="ln1")(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.num_heads, dtype=self.dtype,
                                            name="attn")(h, h, mask=mask)
    h = nn.LayerNorm(dtype=self.dtype, name="ln2")(x)
    h = nn.gelu(nn.Dense(4 * self.d_model, dtype=self.dtype, name="fc")(h))
    return x + nn.Dense(self.d_model, dtype=self.dtype, name="proj")(h)


class GPTTiny(nn.Module):
  """A tiny decoder-only transformer; the output projection is the input embedding (tied weights)."""

  vocab: int = 64
  seq_len: int = 16
  d_model: int = 32
  num_heads: int = 2
  num_blocks: int = 2
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, tokens):
    wte = nn.Embed(self.vocab, self.d_model, dtype=self.dtype, name="wte")
    wpe = nn.Embed(self.seq_len, self.d_model, dtype=self.dtype, name="wpe",
                   embedding_init=nn.initializers.normal(0.02))
    x = wte(tokens) + wpe(jnp.arange(tokens.shape[1]))[None]
    for i in range(self.num_blocks):
      x = Block(self.d_model, self.num_heads, dtype=self.dtype, name=f"block{i}")(x)
    x = nn.LayerNorm(dtype=self.dtype, name="ln_f")(x)
    return wte.attend(x)  # tied: logits = x @ wte.embedding.T


# --------------------------------------------------------------------------------------------------
# Synthetic tasks (a fixed learnable signal; noise and labels drawn from the caller's rng)


def _templates(shape: tuple[int, ...]) -> np.ndarray:
  return np.random.default_rng(_SIGNAL_SEED).normal(size=(NUM_CLASSES, *shape)).astype(np.float32)


def _class_batch(shape: tuple[int, ...]) -> Callable[[jax.Array, int], dict[str, jax.Array]]:
  templates = _templates(shape)

  def make(rng, batch_size):
    ky, kx = jax.random.split(rng)
    y = jax.random.randint(ky, (batch_size,), 0, NUM_CLASSES)
    x = jnp.asarray(templates)[y] + jax.random.normal(kx, (batch_size, *shape), jnp.float32)
    return {"x": x, "y": y}

  return _FastJit(make, static=1)


def _token_batch(vocab: int, seq_len: int) -> Callable[[jax.Array, int], dict[str, jax.Array]]:
  # next token = perm[token] with probability 0.9, else uniform noise: a learnable bigram signal
  perm = np.random.default_rng(_SIGNAL_SEED).permutation(vocab).astype(np.int32)

  def make(rng, batch_size):
    k0, kn, kc = jax.random.split(rng, 3)
    start = jax.random.randint(k0, (batch_size,), 0, vocab)
    noise = jax.random.randint(kn, (seq_len, batch_size), 0, vocab)
    keep = jax.random.uniform(kc, (seq_len, batch_size)) < 0.9
    p = jnp.asarray(perm)

    def step(tok, inp):
      nz, kp = inp
      nxt = jnp.where(kp, p[tok], nz)
      return nxt, nxt

    _, rest = jax.lax.scan(step, start, (noise, keep))
    seq = jnp.concatenate([start[:, None], rest.T], axis=1)  # (B, seq_len + 1)
    return {"x": seq[:, :-1], "y": seq[:, 1:]}

  return _FastJit(make, static=1)


def _xent(logits, labels):
  logits = logits.astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


# --------------------------------------------------------------------------------------------------
# The registry


@dataclass(frozen=True, kw_only=True)
class TrainableModel:
  """A small flax model with a synthetic task.

  Attributes:
    name: registry name ('mlp', 'cnn', 'gpt-tiny', 'resnet-small').
    module: the flax linen module (computes in `param_dtype`).
    input_shape: shape of one example's input (without the batch axis).
    input_dtype: 'float32' (images, features) or 'int32' (tokens).
    default_batch_size: global batch size (divisible by 8 devices).
    param_dtype: 'float32' or 'bfloat16': the dtype of every parameter (and so of every gradient).
  """

  name: str
  module: nn.Module = field(repr=False, compare=False)
  input_shape: tuple[int, ...]
  input_dtype: str
  default_batch_size: int
  param_dtype: str = "float32"
  _make_batch: Callable[[jax.Array, int], dict[str, jax.Array]] = field(repr=False, compare=False)

  def init(self, rng: jax.Array) -> dict[str, Any]:
    """The variables `{'params': {...}}`, every leaf cast to `param_dtype` (paths 'params/...')."""
    return self._init(rng)

  @functools.cached_property
  def _init(self) -> Callable[[jax.Array], dict[str, Any]]:
    # jitted: flax's eager init dispatches hundreds of small ops, seconds on a loaded 2-core CPU
    def init(rng):
      x = jnp.zeros((1, *self.input_shape), self.input_dtype)
      variables = self.module.init(rng, x)
      variables = {"params": variables["params"]}  # these models have no other collections
      dtype = jnp.dtype(self.param_dtype)
      return jax.tree_util.tree_map(lambda p: p.astype(dtype), variables)

    return _FastJit(init)

  def abstract_params(self) -> dict[str, Any]:
    """`init`'s result as ShapeDtypeStructs, without computing anything (`jax.eval_shape`)."""
    return jax.eval_shape(self.init, jax.random.key(0))

  def apply(self, params: Mapping[str, Any], x: jax.Array) -> jax.Array:
    """Logits for inputs `x` (float32 logits whatever `param_dtype`)."""
    return self.module.apply(params, x).astype(jnp.float32)

  def loss_fn(self, params: Mapping[str, Any], batch: Mapping[str, jax.Array]) -> jax.Array:
    """Mean cross-entropy over the batch (and over positions for 'gpt-tiny'), a float32 scalar."""
    return _xent(self.module.apply(params, batch["x"]), batch["y"])

  def make_batch(self, rng: jax.Array, batch_size: int | None = None) -> dict[str, jax.Array]:
    """A synthetic batch `{'x': inputs, 'y': labels}`, deterministic in `rng`; leading axis = batch.

    Raises:
      ValueError: `batch_size` is not a positive integer.
    """
    n = self.default_batch_size if batch_size is None else batch_size
    check_int(f"{self.name}.make_batch", "batch_size", n, lo=1,
              fix=f"The default is {self.default_batch_size}.")
    return self._make_batch(rng, int(n))

  def forward_paths(self, params: Any | None = None) -> tuple[str, ...]:
    """Parameter paths in forward order (first use in the loss's jaxpr); see `forward_paths`."""
    params = self.abstract_params() if params is None else params
    batch = jax.eval_shape(lambda k: self.make_batch(k, 2), jax.random.key(0))
    return forward_paths(self.loss_fn, params, batch)


def _build(name: str, dtype) -> tuple[nn.Module, tuple[int, ...], str, Callable]:
  if name == "mlp":
    return MLP(dtype=dtype), (16,), "float32", _class_batch((16,))
  if name == "cnn":
    return CNN(dtype=dtype), (16, 16, 3), "float32", _class_batch((16, 16, 3))
  if name == "resnet-small":
    return ResNetSmall(dtype=dtype), (16, 16, 3), "float32", _class_batch((16, 16, 3))
  if name == "gpt-tiny":
    m = GPTTiny(dtype=dtype)
    return m, (m.seq_len,), "int32", _token_batch(m.vocab, m.seq_len)
  raise AssertionError(name)


MODELS: tuple[str, ...] = ("mlp", "cnn", "gpt-tiny", "resnet-small")


@functools.lru_cache(maxsize=None)
def get_model(name: str, *, param_dtype: str = "float32") -> TrainableModel:
  """A small trainable model by name.

  Args:
    name: one of `MODELS`: 'mlp', 'cnn', 'gpt-tiny', 'resnet-small'.
    param_dtype: 'float32' or 'bfloat16'; parameters, gradients and compute use it (the loss is float32).

  Raises:
    ValueError: unknown name or dtype (the message lists the valid ones).

  The result is cached: the same (name, param_dtype) gives the same object (and its jitted init).
  """
  if name not in MODELS:
    raise ValueError(f"get_model(name={name!r}): unknown model; expected one of {list(MODELS)}.")
  if param_dtype not in PARAM_DTYPES:
    raise ValueError(f"get_model({name!r}, param_dtype={param_dtype!r}): expected one of "
                     f"{list(PARAM_DTYPES)}.")
  module, shape, in_dtype, make = _build(name, jnp.dtype(param_dtype))
  return TrainableModel(name=name, module=module, input_shape=shape, input_dtype=in_dtype,
                        default_batch_size=32, param_dtype=param_dtype, _make_batch=make)


def _main() -> None:
  """`python -m prophet_jax.models.registry`: size, compile and step time of each model (one device)."""
  import time

  import optax

  print(f"{'model':13s} {'dtype':9s} {'params':>7s} {'leaves':>6s} {'compile_s':>9s} {'step_ms':>8s} "
        f"{'loss 0 -> 50':>15s}")
  for dtype in PARAM_DTYPES:
    for name in MODELS:
      m = get_model(name, param_dtype=dtype)
      params = m.init(jax.random.key(0))
      tx = optax.sgd(0.3 if name == "gpt-tiny" else 0.05, momentum=0.9)

      def step(p, s, b, m=m, tx=tx):
        loss, g = jax.value_and_grad(m.loss_fn)(p, b)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

      batches = [m.make_batch(jax.random.key(i)) for i in range(50)]
      state = tx.init(params)
      t = time.perf_counter()
      compiled = jax.jit(step).lower(params, state, batches[0]).compile()
      compile_s = time.perf_counter() - t
      losses, times = [], []
      for b in batches:
        t = time.perf_counter()
        params, state, loss = compiled(params, state, b)
        loss.block_until_ready()
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
      print(f"{name:13s} {dtype:9s} {num_params(params):7d} {len(jax.tree_util.tree_leaves(params)):6d} "
            f"{compile_s:9.2f} {1e3 * float(np.median(times)):8.2f} {losses[0]:7.3f} -> "
            f"{np.mean(losses[-5:]):5.3f}")


if __name__ == "__main__":
  _main()
