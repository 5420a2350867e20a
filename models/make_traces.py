"""Generate the bundled traces `{model}-{device}.json` (GradientProfile, method='estimated').

Run from the repository root:  `python models/make_traces.py [OUT_DIR [NAME ...]]`  (writes
models/traces/*.json, or only the traces named, e.g. `llama-8b-h100`).

Pure (numpy and prophet_jax._values._types only, never jax). Each published model (ResNet-50, VGG-16,
BERT-base, GPT-2 small) is written out as a list of LAYERS in forward order; a layer carries its
parameter leaves (the same paths and shapes as the flax definitions in `models/zoo.py`: a test checks
that they agree) and the operations it runs. Parameter-free operations (ReLU, pooling, residual adds,
the attention core, the loss) are charged to the nearest parameterised layer BEFORE them in the
forward pass, so in the backward pass they run just before that layer's weight gradients.

Timing model (all of it is also written into each profile's `notes`):

* roofline per operation: t = max(flops / (peak * flop_eff), bytes / (bandwidth * bw_eff)) + launch_s;
  a layer's time is the sum over its operations.
* backward: 2x the forward FLOPs and 2x the forward memory traffic of each operation (weight and
  data gradients), except embedding lookups, whose backward writes the dense (vocab x d) gradient.
* ready_s: backward runs layers from the last to the first; every leaf of a layer is ready when that
  layer's backward segment ends. GPT-2's tied `wte` is row 0 (the forward reads it first, in the
  lookup) and its gradient is complete only when the lookup's backward, the last segment, ends:
  ready_s = backward_s. Its LM-head use (logits = h @ wte.T, and the head's share of the wte
  gradient) is charged to `ln_f`, the layer before it in the forward pass.
* devices: v100 = fp32 compute (15.7 TFLOP/s, 900 GB/s, 4-byte activations and weights);
  h100 = bf16 compute (989 TFLOP/s dense, 3.35 TB/s, 2-byte activations and weight copies).
  Gradients (the rows' dtype) are float32 on both: mixed precision keeps fp32 master weights and
  reduces fp32 gradients (as PyTorch AMP + DDP does).
* update_s per leaf: the optimizer's memory traffic at bw * bw_eff: SGD with momentum for the CNNs
  (read p, g, m; write p, m: 20 bytes per parameter), AdamW for the transformers (read p, g, m, v;
  write p, m, v: 28 bytes), plus 2 bytes on h100 for the bf16 weight copy; one fused (multi-tensor)
  kernel, so no launch cost per leaf.
* batches: ResNet-50 and VGG-16: 64 images of 224x224; BERT-base: 32 x 128 tokens; GPT-2: 8 x 1024
  tokens (per device). Memory capacity is not checked. The attention scores are materialised (no
  flash attention). BERT is `BertModel` (embeddings, 12 layers, pooler): the pre-training heads (MLM,
  NSP) are NOT included (neither rows nor time).
* FLOPs of convolutions are direct-convolution FLOPs (cuDNN's Winograd/FFT algorithms are not
  modelled). Sanity check: ResNet-50 on v100 comes out at 287 img/s, against 367 img/s measured for
  FP32 ResNet-50 v1.5 on one V100 16GB (NVIDIA DeepLearningExamples README, pytorch-21.03 container):
  about 20% pessimistic.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script from a checkout: `python models/make_traces.py`
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from prophet_jax._values._types import GradientProfile, ProfileRow  # noqa: E402

MODELS = ("resnet50", "vgg16", "bert-base", "gpt2")
# Decoder-only transformers for FSDP / HSDP planning (bench/fsdp.py), on h100 only; bfloat16 rows.
DECODERS = ("llama-1b", "llama-8b")
DECODER_DEVICES = ("h100",)


@dataclass(frozen=True)
class Device:
  name: str
  peak_flops: float      # FLOP/s
  bandwidth: float       # bytes/s
  act_bytes: int         # bytes per activation element
  weight_bytes: int      # bytes per weight element as read by the compute
  flop_eff: float        # achieved fraction of peak FLOP/s on large matmuls / convolutions
  bw_eff: float          # achieved fraction of peak memory bandwidth
  launch_s: float        # per-kernel overhead
  extra_update_bytes: int  # optimizer bytes per parameter beyond fp32 state (bf16 weight copy)
  description: str


DEVICES = {
    "v100": Device("v100", 15.7e12, 900e9, 4, 4, 0.6, 0.8, 5e-6, 0,
                   "V100-class, fp32 compute: 15.7 TFLOP/s, 900 GB/s"),
    "h100": Device("h100", 989e12, 3.35e12, 2, 2, 0.5, 0.8, 4e-6, 2,
                   "H100-class, bf16 compute: 989 TFLOP/s dense, 3.35 TB/s"),
}


@dataclass
class Op:
  """One kernel of the forward pass: FLOPs and activation / weight elements moved (batch included)."""

  flops: float = 0.0
  act: float = 0.0         # activation elements read + written
  weights: float = 0.0     # weight elements read
  bwd_act: float | None = None  # backward activation elements (default 2 * act)

  def fwd_s(self, d: Device) -> float:
    nbytes = self.act * d.act_bytes + self.weights * d.weight_bytes
    return max(self.flops / (d.peak_flops * d.flop_eff), nbytes / (d.bandwidth * d.bw_eff)) + d.launch_s

  def bwd_s(self, d: Device) -> float:
    act = 2 * self.act if self.bwd_act is None else self.bwd_act
    nbytes = act * d.act_bytes + 2 * self.weights * d.weight_bytes
    return (max(2 * self.flops / (d.peak_flops * d.flop_eff), nbytes / (d.bandwidth * d.bw_eff))
            + 2 * d.launch_s)


@dataclass
class Layer:
  name: str                                      # e.g. 'params/layer1_0/conv1'
  params: list[tuple[str, tuple[int, ...]]]      # (leaf name, shape) in forward (first-use) order
  ops: list[Op] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------
# Layer builders (B: batch; spatial sizes are square)


def _conv(name, b, h, cin, cout, k, stride=1, bias=False):
  ho = math.ceil(h / stride)
  params = [("kernel", (k, k, cin, cout))] + ([("bias", (cout,))] if bias else [])
  op = Op(flops=2 * b * ho * ho * k * k * cin * cout, act=b * (h * h * cin + ho * ho * cout),
          weights=k * k * cin * cout)
  return Layer(f"params/{name}", params, [op]), ho


def _norm(name, n_elems, c):
  # training-mode batch/layer norm (+ the fused activation): read for statistics, read, write
  return Layer(f"params/{name}", [("scale", (c,)), ("bias", (c,))], [Op(flops=8 * n_elems, act=3 * n_elems)])


def _dense(name, n, din, dout, bias=True):
  params = [("kernel", (din, dout))] + ([("bias", (dout,))] if bias else [])
  return Layer(f"params/{name}", params, [Op(flops=2 * n * din * dout, act=n * (din + dout),
                                              weights=din * dout)])


def _eltwise(n_elems, reads=1):
  return Op(flops=n_elems, act=(reads + 1) * n_elems)


def _embed(name, n, vocab, d):
  # lookup: read n rows, write n rows; backward: zero + scatter-add into the dense (vocab, d) gradient
  return Layer(f"params/{name}", [("embedding", (vocab, d))],
               [Op(act=2 * n * d, bwd_act=2 * n * d + 2 * vocab * d)])


def _attention_core(b, t, d, heads):
  scores = b * heads * t * t
  return [Op(flops=2 * b * t * t * d, act=2 * b * t * d + scores),   # q @ k^T
          Op(flops=5 * scores, act=2 * scores),                       # scale, mask, softmax
          Op(flops=2 * b * t * t * d, act=scores + 2 * b * t * d)]    # p @ v


# --------------------------------------------------------------------------------------------------
# The four models, layers in forward order


def resnet50_layers(b=64):
  layers = []
  conv, h = _conv("conv1", b, 224, 3, 64, 7, 2)
  layers.append(conv)
  stem_bn = _norm("bn1", b * h * h * 64, 64)
  h2 = math.ceil(h / 2)
  stem_bn.ops.append(Op(flops=9 * b * h2 * h2 * 64, act=b * (h * h + h2 * h2) * 64))  # max pool
  layers.append(stem_bn)
  h, cin = h2, 64
  for stage, (planes, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3)), start=1):
    for blk in range(blocks):
      stride = 2 if (blk == 0 and stage > 1) else 1
      p = f"layer{stage}_{blk}"
      c1, _ = _conv(f"{p}/conv1", b, h, cin, planes, 1)
      c2, ho = _conv(f"{p}/conv2", b, h, planes, planes, 3, stride)
      c3, _ = _conv(f"{p}/conv3", b, ho, planes, 4 * planes, 1)
      layers += [c1, _norm(f"{p}/bn1", b * h * h * planes, planes),
                 c2, _norm(f"{p}/bn2", b * ho * ho * planes, planes),
                 c3, _norm(f"{p}/bn3", b * ho * ho * 4 * planes, 4 * planes)]
      if blk == 0:
        dc, _ = _conv(f"{p}/downsample_conv", b, h, cin, 4 * planes, 1, stride)
        layers += [dc, _norm(f"{p}/downsample_bn", b * ho * ho * 4 * planes, 4 * planes)]
      layers[-1].ops.append(_eltwise(b * ho * ho * 4 * planes, reads=2))  # residual add + relu
      h, cin = ho, 4 * planes
  layers[-1].ops.append(_eltwise(b * h * h * cin))  # global average pool
  fc = _dense("fc", b, 2048, 1000)
  fc.ops.append(_eltwise(3 * b * 1000))  # softmax cross-entropy
  return layers + [fc]


def vgg16_layers(b=64):
  layers, h, cin = [], 224, 3
  for s, stage in enumerate(((64, 64), (128, 128), (256, 256, 256), (512, 512, 512),
                             (512, 512, 512)), start=1):
    for i, cout in enumerate(stage, start=1):
      conv, h = _conv(f"conv{s}_{i}", b, h, cin, cout, 3, bias=True)
      conv.ops.append(_eltwise(b * h * h * cout))  # relu
      layers.append(conv)
      cin = cout
    ho = h // 2
    layers[-1].ops.append(Op(flops=4 * b * ho * ho * cin, act=b * (h * h + ho * ho) * cin))  # max pool
    h = ho
  layers += [_dense("fc6", b, 7 * 7 * 512, 4096), _dense("fc7", b, 4096, 4096), _dense("fc8", b, 4096, 1000)]
  for fc in layers[-3:-1]:
    fc.ops.append(_eltwise(b * 4096))  # relu (+ dropout)
  layers[-1].ops.append(_eltwise(3 * b * 1000))  # softmax cross-entropy
  return layers


def bert_base_layers(b=32, t=128, d=768, heads=12, ff=3072, vocab=30522, max_len=512, depth=12):
  n = b * t
  emb = [_embed("embeddings/word_embeddings", n, vocab, d),
         _embed("embeddings/position_embeddings", n, max_len, d),
         _embed("embeddings/token_type_embeddings", n, 2, d)]
  for e in emb[1:]:
    e.ops.append(_eltwise(n * d, reads=2))  # the sum
  layers = emb + [_norm("embeddings/LayerNorm", n * d, d)]
  for i in range(depth):
    p = f"layer_{i}"
    q, k, v = (_dense(f"{p}/attention/{x}", n, d, d) for x in ("query", "key", "value"))
    v.ops += _attention_core(b, t, d, heads)
    out = _dense(f"{p}/attention_output", n, d, d)
    out.ops.append(_eltwise(n * d, reads=2))  # residual
    inter = _dense(f"{p}/intermediate", n, d, ff)
    inter.ops.append(_eltwise(n * ff))  # gelu
    o = _dense(f"{p}/output", n, ff, d)
    o.ops.append(_eltwise(n * d, reads=2))  # residual
    layers += [q, k, v, out, _norm(f"{p}/attention_ln", n * d, d), inter, o,
               _norm(f"{p}/output_ln", n * d, d)]
  pooler = _dense("pooler", b, d, d)
  pooler.ops.append(_eltwise(b * d))  # tanh
  return layers + [pooler]


def gpt2_layers(b=8, t=1024, d=768, heads=12, vocab=50257, max_len=1024, depth=12):
  n = b * t
  wpe = _embed("wpe", n, max_len, d)
  wpe.ops.append(_eltwise(n * d, reads=2))  # the sum
  layers = [_embed("wte", n, vocab, d), wpe]
  for i in range(depth):
    p = f"h_{i}"
    c_attn = _dense(f"{p}/attn/c_attn", n, d, 3 * d)
    c_attn.ops += _attention_core(b, t, d, heads)
    proj = _dense(f"{p}/attn/c_proj", n, d, d)
    proj.ops.append(_eltwise(n * d, reads=2))  # residual
    fc = _dense(f"{p}/mlp/c_fc", n, d, 4 * d)
    fc.ops.append(_eltwise(4 * n * d))  # gelu
    mproj = _dense(f"{p}/mlp/c_proj", n, 4 * d, d)
    mproj.ops.append(_eltwise(n * d, reads=2))  # residual
    layers += [_norm(f"{p}/ln_1", n * d, d), c_attn, proj, _norm(f"{p}/ln_2", n * d, d), fc, mproj]
  ln_f = _norm("ln_f", n * d, d)
  # the tied LM head (logits = h @ wte.T) and the loss run after ln_f: charged to ln_f
  ln_f.ops.append(Op(flops=2 * n * d * vocab, act=n * (d + vocab), weights=vocab * d))
  ln_f.ops.append(Op(flops=5 * n * vocab, act=3 * n * vocab))  # softmax cross-entropy
  return layers + [ln_f]


def _flash_attention_core(b, t, d):
  # causal flash attention: q @ k^T and p @ v over half the (t x t) scores, nothing materialised
  return [Op(flops=2 * b * t * t * d, act=4 * b * t * d)]


def _rms(name, n_elems, c):
  return Layer(f"params/{name}", [("scale", (c,))], [Op(flops=4 * n_elems, act=2 * n_elems)])


def decoder_layers(b=2, t=4096, d=2048, heads=32, kv_heads=8, ff=8192, vocab=128256, depth=16, tied=True):
  """A Llama-style decoder (RMSNorm, grouped-query attention, SwiGLU MLP, rotary positions): Llama 3.2
  1B at the defaults (tied embeddings), Llama 3 8B with d=4096, ff=14336, depth=32, tied=False."""
  n = b * t
  kv = d // heads * kv_heads
  layers = [_embed("embed", n, vocab, d)]
  for i in range(depth):
    p = f"layer_{i}"
    q = _dense(f"{p}/attn/q", n, d, d, bias=False)
    k = _dense(f"{p}/attn/k", n, d, kv, bias=False)
    v = _dense(f"{p}/attn/v", n, d, kv, bias=False)
    v.ops.append(_eltwise(2 * n * (d + kv)))             # rotary on q and k
    v.ops += _flash_attention_core(b, t, d)
    o = _dense(f"{p}/attn/o", n, d, d, bias=False)
    o.ops.append(_eltwise(n * d, reads=2))               # residual
    gate = _dense(f"{p}/mlp/gate", n, d, ff, bias=False)
    up = _dense(f"{p}/mlp/up", n, d, ff, bias=False)
    up.ops.append(_eltwise(n * ff, reads=2))             # silu(gate) * up
    down = _dense(f"{p}/mlp/down", n, ff, d, bias=False)
    down.ops.append(_eltwise(n * d, reads=2))            # residual
    layers += [_rms(f"{p}/attn_norm", n * d, d), q, k, v, o, _rms(f"{p}/mlp_norm", n * d, d), gate, up, down]
  norm = _rms("norm", n * d, d)
  head_op = Op(flops=2 * n * d * vocab, act=n * (d + vocab), weights=vocab * d)
  loss = Op(flops=5 * n * vocab, act=3 * n * vocab)      # softmax cross-entropy
  if tied:                                               # logits = h @ embed.T: charged to the norm
    norm.ops += [head_op, loss]
    return layers + [norm]
  head = Layer("params/lm_head", [("kernel", (d, vocab))], [head_op, loss])
  return layers + [norm, head]


def llama_8b_layers():
  return decoder_layers(d=4096, ff=14336, depth=32, tied=False)


BUILDERS = {"resnet50": resnet50_layers, "vgg16": vgg16_layers, "bert-base": bert_base_layers,
            "gpt2": gpt2_layers, "llama-1b": decoder_layers, "llama-8b": llama_8b_layers}
BATCH = {"resnet50": "64 images of 224x224", "vgg16": "64 images of 224x224",
         "bert-base": "32 sequences x 128 tokens", "gpt2": "8 sequences x 1024 tokens",
         "llama-1b": "2 sequences x 4096 tokens", "llama-8b": "2 sequences x 4096 tokens"}
OPTIMIZER = {"resnet50": ("SGD momentum", 20), "vgg16": ("SGD momentum", 20),
             "bert-base": ("AdamW", 28), "gpt2": ("AdamW", 28), "llama-1b": ("AdamW", 28),
             "llama-8b": ("AdamW", 28)}
# bytes of a gradient (and gathered parameter) element: float32 (fp32 master weights, fp32 reduction)
# except the decoders, planned for FSDP with bfloat16 gathers and reductions (PyTorch FSDP2's
# MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16), MaxText's bf16 all-gathers)
GRAD_DTYPE = {"llama-1b": ("bfloat16", 2), "llama-8b": ("bfloat16", 2)}


def notes_for(model: str, device: Device) -> str:
  opt, opt_bytes = OPTIMIZER[model]
  extra = {
      "gpt2": " Tied embeddings: params/wte/embedding is row 0 (the forward pass reads it first) and "
              "its gradient is complete only at the end of backward (ready_s = backward_s); the LM "
              "head (logits = h @ wte.T) and the loss are charged to ln_f.",
      "bert-base": " BertModel (embeddings, 12 layers, pooler; 109,482,240 parameters): the MLM and "
                   "NSP pre-training heads are NOT included.",
      "resnet50": " BatchNorm scale and bias are gradient rows; running statistics are not. Sanity "
                  "check (v100): 64 / (forward + backward) = 287 img/s, against 367 img/s measured "
                  "for FP32 ResNet-50 v1.5 on one V100 16GB (NVIDIA DeepLearningExamples, "
                  "pytorch-21.03); direct-convolution FLOPs, no Winograd.",
      "vgg16": "",
      "llama-1b": " Llama 3.2 1B shapes (1,235,814,400 parameters; tied embeddings: the LM head is "
                  "charged to the final norm); grouped-query attention (8 KV heads), SwiGLU MLP, causal "
                  "flash attention (scores never materialised). Rows are bfloat16: FSDP gathers the "
                  "parameters and reduces the gradients in bf16 (fp32 master weights in the update).",
      "llama-8b": " Llama 3 8B shapes (8,030,261,248 parameters; untied LM head); grouped-query "
                  "attention (8 KV heads), SwiGLU MLP, causal flash attention. Rows are bfloat16: FSDP "
                  "gathers the parameters and reduces the gradients in bf16 (fp32 master weights in the "
                  "update).",
  }[model]
  return (f"Estimated from FLOPs and memory traffic (models/make_traces.py): {device.description}; "
          f"per-op roofline t = max(flops / (peak * {device.flop_eff}), bytes / (bandwidth * "
          f"{device.bw_eff})) + {device.launch_s * 1e6:g} us launch; {device.act_bytes}-byte "
          f"activations and weights in compute; gradients {GRAD_DTYPE.get(model, ('float32',))[0]} "
          f"(fp32 master weights). Batch per "
          f"device: {BATCH[model]}. Backward = 2x forward FLOPs and memory traffic per op (embedding "
          f"backward writes the dense table gradient); backward runs last layer to first, and a "
          f"layer's leaves are ready when its backward segment ends. Parameter-free ops (activations, "
          f"pooling, residual adds, attention core, loss) are charged to the parameterised layer "
          f"before them. update_s: {opt} at {opt_bytes + device.extra_update_bytes} bytes per "
          f"parameter at bandwidth * {device.bw_eff}. Rows in forward (priority) order; paths and "
          f"shapes as in prophet_jax.models.zoo.{extra}")


def build_profile(model: str, device: str) -> GradientProfile:
  """The estimated GradientProfile of `model` ('resnet50', 'vgg16', 'bert-base', 'gpt2') on `device`."""
  if model not in BUILDERS:
    raise ValueError(f"build_profile: unknown model {model!r}; expected one of {list(BUILDERS)}.")
  if device not in DEVICES:
    raise ValueError(f"build_profile: unknown device {device!r}; expected one of {list(DEVICES)}.")
  dev = DEVICES[device]
  layers = BUILDERS[model]()
  fwd = [sum(op.fwd_s(dev) for op in layer.ops) for layer in layers]
  bwd = [sum(op.bwd_s(dev) for op in layer.ops) for layer in layers]
  ready, t = [0.0] * len(layers), 0.0
  for i in reversed(range(len(layers))):
    t += bwd[i]
    ready[i] = t
  backward_s = t
  _, opt_bytes = OPTIMIZER[model]
  per_param_update_s = (opt_bytes + dev.extra_update_bytes) / (dev.bandwidth * dev.bw_eff)
  rows = []
  for i, layer in enumerate(layers):
    for j, (leaf, shape) in enumerate(layer.params):
      size = math.prod(shape)
      dtype, isz = GRAD_DTYPE.get(model, ("float32", 4))
      rows.append(ProfileRow(path=f"{layer.name}/{leaf}", layer=layer.name, shape=shape, dtype=dtype,
                             nbytes=isz * size, ready_s=ready[i], fwd_s=fwd[i] if j == 0 else 0.0,
                             update_s=size * per_param_update_s))
  return GradientProfile(rows=tuple(rows), forward_s=sum(r.fwd_s for r in rows), backward_s=backward_s,
                         method="estimated", model=model, device=device, notes=notes_for(model, dev))


def main(out_dir: str | Path | None = None, only: tuple[str, ...] = ()) -> list[Path]:
  """Write every bundled trace (or those named in `only`, e.g. ('llama-8b-h100',)) into `out_dir`."""
  out = Path(out_dir) if out_dir else Path(__file__).resolve().parent / "traces"
  written = []
  pairs = [(m, d) for m in MODELS for d in DEVICES] + [(m, d) for m in DECODERS for d in DECODER_DEVICES]
  for model, device in pairs:
    if only and f"{model}-{device}" not in only:
      continue
    prof = build_profile(model, device)
    path = out / f"{model}-{device}.json"
    path.write_text(prof.to_json(indent=1) + "\n")
    written.append(path)
    print(f"{path.name:20s} rows={len(prof.rows):4d} MB={prof.total_nbytes / 1e6:8.2f} "
          f"fwd={prof.forward_s * 1e3:8.2f} ms bwd={prof.backward_s * 1e3:8.2f} ms "
          f"update={prof.update_s * 1e3:6.2f} ms")
  return written


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else None, tuple(sys.argv[2:]))
