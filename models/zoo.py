"""Flax definitions of the published models behind the bundled traces: ResNet-50, VGG-16, BERT-base, GPT-2.

These are parameter trees for sizes and paths (built with `jax.eval_shape`, nothing is allocated), not
models to train here. Their leaf paths and shapes are exactly the rows of the bundled traces
(`models/make_traces.py` writes the same names; a test checks they agree), and their parameter counts
match the published models:

| name        | parameters  | what is counted                                                           |
| ----------- | ----------- | ------------------------------------------------------------------------- |
| `resnet50`  | 25,557,032  | torchvision ResNet-50: convs (no bias), BatchNorm scale+bias, fc 2048x1000 |
| `vgg16`     | 138,357,544 | torchvision VGG-16 (no BN): 13 convs, fc6/fc7/fc8 with biases             |
| `bert-base` | 109,482,240 | HF `BertModel` (uncased, vocab 30,522): embeddings, 12 layers, pooler;    |
|             |             | NOT the pre-training heads (MLM transform + decoder bias, NSP)            |
| `gpt2`      | 124,439,808 | GPT-2 small: wte (tied with the LM head, counted once), wpe, 12 blocks,   |
|             |             | ln_f                                                                      |

ResNet-50 uses flax's BatchNorm (as the published model does); only its `params` (scale, bias) are
gradient leaves: the running statistics live in the `batch_stats` collection and are not counted. The
models are channels-last (NHWC, flax's default), so VGG's fc6 kernel is (7*7*512, 4096).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import flax.linen as nn

__all__ = ["ARCHITECTURES", "Architecture", "architecture", "reference_param_count"]

_REFERENCE = {"resnet50": 25_557_032, "vgg16": 138_357_544, "bert-base": 109_482_240,
              "gpt2": 124_439_808}
ARCHITECTURES: tuple[str, ...] = tuple(_REFERENCE)


def reference_param_count(name: str) -> int:
  """The published parameter count of `name` (see the module docstring for what is counted)."""
  if name not in _REFERENCE:
    raise ValueError(f"reference_param_count({name!r}): unknown architecture; expected one of "
                     f"{list(ARCHITECTURES)}.")
  return _REFERENCE[name]


# --------------------------------------------------------------------------------------------------
# ResNet-50


class Bottleneck(nn.Module):
  planes: int
  stride: int = 1
  downsample: bool = False

  @nn.compact
  def __call__(self, x):
    bn = lambda name: nn.BatchNorm(use_running_average=True, name=name)  # noqa: E731
    y = nn.relu(bn("bn1")(nn.Conv(self.planes, (1, 1), use_bias=False, name="conv1")(x)))
    y = nn.Conv(self.planes, (3, 3), strides=(self.stride,) * 2, use_bias=False, name="conv2")(y)
    y = nn.relu(bn("bn2")(y))
    y = bn("bn3")(nn.Conv(4 * self.planes, (1, 1), use_bias=False, name="conv3")(y))
    if self.downsample:
      x = nn.Conv(4 * self.planes, (1, 1), strides=(self.stride,) * 2, use_bias=False,
                  name="downsample_conv")(x)
      x = bn("downsample_bn")(x)
    return nn.relu(x + y)


class ResNet50(nn.Module):
  num_classes: int = 1000

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(64, (7, 7), strides=(2, 2), padding=3, use_bias=False, name="conv1")(x)
    x = nn.relu(nn.BatchNorm(use_running_average=True, name="bn1")(x))
    x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    for stage, (planes, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3)), start=1):
      for b in range(blocks):
        stride = 2 if (b == 0 and stage > 1) else 1
        x = Bottleneck(planes, stride, downsample=(b == 0), name=f"layer{stage}_{b}")(x)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes, name="fc")(x)


# --------------------------------------------------------------------------------------------------
# VGG-16

VGG16_CFG = ((64, 64), (128, 128), (256, 256, 256), (512, 512, 512), (512, 512, 512))


class VGG16(nn.Module):
  num_classes: int = 1000

  @nn.compact
  def __call__(self, x):
    for s, stage in enumerate(VGG16_CFG, start=1):
      for i, feat in enumerate(stage, start=1):
        x = nn.relu(nn.Conv(feat, (3, 3), name=f"conv{s}_{i}")(x))
      x = nn.max_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(4096, name="fc6")(x))
    x = nn.relu(nn.Dense(4096, name="fc7")(x))
    return nn.Dense(self.num_classes, name="fc8")(x)


# --------------------------------------------------------------------------------------------------
# Transformers (plain Dense layers, so kernels are (d_in, d_out) as in the published checkpoints)


def _attend(q, k, v, num_heads: int, causal: bool):
  b, t, d = q.shape
  split = lambda a: a.reshape(b, t, num_heads, d // num_heads)  # noqa: E731
  s = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / jnp.sqrt(d // num_heads).astype(q.dtype)
  if causal:
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, jnp.finfo(s.dtype).min)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), split(v)).reshape(b, t, d)


class _Dense(nn.Module):
  """A container of named Dense layers (so paths nest as in the checkpoints: attn/c_attn/kernel)."""

  features: tuple[tuple[str, int], ...]

  @nn.compact
  def __call__(self, name: str, x):
    return nn.Dense(dict(self.features)[name], name=name)(x)


class BertEmbeddings(nn.Module):
  vocab: int
  max_len: int
  d: int

  @nn.compact
  def __call__(self, tokens):
    t = tokens.shape[1]
    x = nn.Embed(self.vocab, self.d, name="word_embeddings")(tokens)
    x = x + nn.Embed(self.max_len, self.d, name="position_embeddings")(jnp.arange(t))[None]
    x = x + nn.Embed(2, self.d, name="token_type_embeddings")(jnp.zeros_like(tokens))
    return nn.LayerNorm(epsilon=1e-12, name="LayerNorm")(x)


class BertLayer(nn.Module):
  d: int = 768
  heads: int = 12
  ff: int = 3072

  @nn.compact
  def __call__(self, x):
    attn = _Dense(tuple((n, self.d) for n in ("query", "key", "value")), name="attention")
    q, k, v = attn("query", x), attn("key", x), attn("value", x)
    a = nn.Dense(self.d, name="attention_output")(_attend(q, k, v, self.heads, causal=False))
    x = nn.LayerNorm(epsilon=1e-12, name="attention_ln")(x + a)
    h = nn.gelu(nn.Dense(self.ff, name="intermediate")(x))
    return nn.LayerNorm(epsilon=1e-12, name="output_ln")(x + nn.Dense(self.d, name="output")(h))


class BertBase(nn.Module):
  vocab: int = 30522
  max_len: int = 512
  d: int = 768
  layers: int = 12

  @nn.compact
  def __call__(self, tokens):
    x = BertEmbeddings(self.vocab, self.max_len, self.d, name="embeddings")(tokens)
    for i in range(self.layers):
      x = BertLayer(self.d, name=f"layer_{i}")(x)
    return jnp.tanh(nn.Dense(self.d, name="pooler")(x[:, 0]))


class GPT2Block(nn.Module):
  d: int = 768
  heads: int = 12

  @nn.compact
  def __call__(self, x):
    attn = _Dense((("c_attn", 3 * self.d), ("c_proj", self.d)), name="attn")
    mlp = _Dense((("c_fc", 4 * self.d), ("c_proj", self.d)), name="mlp")
    h = nn.LayerNorm(epsilon=1e-5, name="ln_1")(x)
    q, k, v = jnp.split(attn("c_attn", h), 3, axis=-1)
    x = x + attn("c_proj", _attend(q, k, v, self.heads, causal=True))
    h = nn.LayerNorm(epsilon=1e-5, name="ln_2")(x)
    return x + mlp("c_proj", nn.gelu(mlp("c_fc", h)))


class GPT2(nn.Module):
  vocab: int = 50257
  max_len: int = 1024
  d: int = 768
  layers: int = 12

  @nn.compact
  def __call__(self, tokens):
    wte = nn.Embed(self.vocab, self.d, name="wte")
    x = wte(tokens) + nn.Embed(self.max_len, self.d, name="wpe")(jnp.arange(tokens.shape[1]))[None]
    for i in range(self.layers):
      x = GPT2Block(self.d, name=f"h_{i}")(x)
    return wte.attend(nn.LayerNorm(epsilon=1e-5, name="ln_f")(x))  # tied LM head


# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Architecture:
  """A published model's flax definition and the input of one example.

  Attributes:
    name: 'resnet50', 'vgg16', 'bert-base' or 'gpt2'.
    module: the flax module.
    input_shape: one example's input shape (an image HWC, or a token sequence).
    input_dtype: 'float32' (images) or 'int32' (tokens).
    reference_count: the published parameter count.
  """

  name: str
  module: nn.Module = field(repr=False, compare=False)
  input_shape: tuple[int, ...]
  input_dtype: str
  reference_count: int

  def abstract_variables(self, batch: int = 1) -> dict[str, Any]:
    """Every variable collection as ShapeDtypeStructs (`jax.eval_shape`: nothing is computed)."""
    x = jax.ShapeDtypeStruct((batch, *self.input_shape), jnp.dtype(self.input_dtype))
    return jax.eval_shape(self.module.init, jax.random.key(0), x)

  def abstract_params(self) -> dict[str, Any]:
    """`{'params': ...}` as ShapeDtypeStructs: the gradient leaves (paths 'params/...')."""
    return {"params": self.abstract_variables()["params"]}

  def apply(self, params: Mapping[str, Any], x: jax.Array, *, state: Mapping[str, Any] | None = None):
    """The forward pass; `state` holds non-parameter collections (ResNet-50's `batch_stats`)."""
    return self.module.apply({**(state or {}), **params}, x)

  def forward_paths(self, params: Mapping[str, Any] | None = None,
                    state: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """Parameter paths in forward order (first use in the forward pass's jaxpr; nothing is computed).

    Args:
      params: `{'params': ...}` (arrays or ShapeDtypeStructs); default `abstract_params()`.
      state: the other collections (ResNet-50's `batch_stats`); default from `abstract_variables()`.
    """
    from .registry import forward_paths

    if params is None or state is None:
      variables = self.abstract_variables()
      params = {"params": variables["params"]} if params is None else params
      state = {k: v for k, v in variables.items() if k != "params"} if state is None else state
    x = jax.ShapeDtypeStruct((1, *self.input_shape), jnp.dtype(self.input_dtype))
    return forward_paths(lambda p, x, s: self.apply(p, x, state=s), params, x, state)


def architecture(name: str) -> Architecture:
  """The flax definition of a published model: one of `ARCHITECTURES`.

  Raises:
    ValueError: unknown name (the message lists the valid ones).
  """
  if name == "resnet50":
    return Architecture(name=name, module=ResNet50(), input_shape=(224, 224, 3), input_dtype="float32",
                        reference_count=_REFERENCE[name])
  if name == "vgg16":
    return Architecture(name=name, module=VGG16(), input_shape=(224, 224, 3), input_dtype="float32",
                        reference_count=_REFERENCE[name])
  if name == "bert-base":
    return Architecture(name=name, module=BertBase(), input_shape=(128,), input_dtype="int32",
                        reference_count=_REFERENCE[name])
  if name == "gpt2":
    return Architecture(name=name, module=GPT2(), input_shape=(1024,), input_dtype="int32",
                        reference_count=_REFERENCE[name])
  raise ValueError(f"architecture({name!r}): unknown architecture; expected one of {list(ARCHITECTURES)}.")
