"""Bundled traces: `load_trace(name)`, `TRACES`, and the GoogLeNet/K80 trace read at run time.

Pure: numpy and prophet_jax._types only, never jax.

* `{model}-{device}` for model in resnet50, vgg16, bert-base, gpt2 and device in v100, h100: estimated
  GradientProfiles shipped as package data (`models/traces/*.json`, written by `models/make_traces.py`;
  the assumptions are in each profile's `notes`). Read through importlib.resources, so they work from an
  installed wheel as well as from a checkout.
* `googlenet-k80`: the measured GoogLeNet (Caffe, K80 GPUs, MG-WFBP's B-Caffe logs) layer-wise trace, a
  public data set that stays outside the repository. It is read at run time from
  `<checkout>/../shared/traces/googlenet-caffe-k80` (or `./../shared/...`, or `shared_dir=`), and
  reported as absent with `TraceUnavailableError` elsewhere.

GoogLeNet trace model (also in the profile's `notes`): rows are the 128 learnable tensors in Caffe's
parameter order (the prototxt's order, i.e. forward order, auxiliary classifiers where the prototxt
defines them), named after bvlc_googlenet's layers. The log's element counts are the true counts rounded
up to a multiple of 64 (B-Caffe's buffer alignment: 13,379,136 in the log, 13,378,280 true); each is
checked against the architecture and the row holds the TRUE count, as the 1-D shape (numel,), float32.
A layer's weight and bias rows repeat the same backward time: it is counted once per LAYER. Backward
runs from the last layer to the first and a layer's rows are ready when its backward ends; the time of
parameter-free layers (pooling, ReLU, LRN, concat) is not in the trace and so not in backward_s. There
are no forward times in the trace: each layer's forward is modelled as half its backward time.
No optimizer times (update_s = 0).
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import numpy as np

from prophet_jax._errors import TraceUnavailableError
from prophet_jax._types import GradientProfile, ProfileRow

__all__ = ["TRACES", "load_trace", "googlenet_allreduce", "googlenet_available", "googlenet_dir",
           "googlenet_comm_s", "GOOGLENET_NODES", "ALGORITHM_SWITCH_BYTES"]

_BUNDLED_MODELS = ("resnet50", "vgg16", "bert-base", "gpt2")
_BUNDLED_DEVICES = ("v100", "h100")
_BUNDLED = tuple(f"{m}-{d}" for m in _BUNDLED_MODELS for d in _BUNDLED_DEVICES)
TRACES: tuple[str, ...] = _BUNDLED + ("googlenet-k80",)

GOOGLENET_NODES = (2, 4, 8)
GOOGLENET_FWD_PER_BWD = 0.5   # the stated forward-time model: forward = half of backward, per layer
ALGORITHM_SWITCH_BYTES = 12288  # the OSU logs jump between 8 KiB and 12 KiB (MPI changes algorithm)
_SUBDIR = Path("traces") / "googlenet-caffe-k80"


# --------------------------------------------------------------------------------------------------
# Bundled (package data)


def load_trace(name: str, *, nodes: int | None = None,
               shared_dir: str | Path | None = None) -> GradientProfile:
  """A trace by name: one of `TRACES`.

  Args:
    name: '{model}-{device}' ('resnet50-v100', 'gpt2-h100', ...) or 'googlenet-k80'.
    nodes: for 'googlenet-k80' only: the log of 2, 4 or 8 nodes (default 8: tmp8comm.log).
    shared_dir: for 'googlenet-k80' only: the `shared` directory holding traces/googlenet-caffe-k80.

  Raises:
    ValueError: unknown name (the message lists the names); nodes or shared_dir for a bundled trace.
    TraceUnavailableError: 'googlenet-k80' and the public data set is not on this machine.
  """
  if name == "googlenet-k80":
    return _googlenet_profile(8 if nodes is None else nodes, shared_dir)
  if name not in _BUNDLED:
    raise ValueError(f"load_trace({name!r}): unknown trace; expected one of {list(TRACES)}.")
  if nodes is not None or shared_dir is not None:
    raise ValueError(f"load_trace({name!r}, nodes={nodes!r}, shared_dir={shared_dir!r}): nodes and "
                     f"shared_dir apply only to 'googlenet-k80'; a bundled trace takes neither.")
  text = resources.files("prophet_jax.models.traces").joinpath(f"{name}.json").read_text()
  return GradientProfile.from_json(text)


# --------------------------------------------------------------------------------------------------
# GoogLeNet (public data, read at run time)


def _candidate_dirs(shared_dir: str | Path | None) -> list[Path]:
  if shared_dir is not None:
    return [Path(shared_dir) / _SUBDIR]
  here = Path(__file__).resolve()
  # models/_traces.py -> parents[1] is the checkout; its parent holds shared/ (also try one level up,
  # for layouts such as <root>/main/models with <root>/shared)
  out = [here.parents[1].parent / "shared" / _SUBDIR, here.parents[1] / "shared" / _SUBDIR]
  cwd = Path.cwd()
  out += [cwd.parent / "shared" / _SUBDIR, cwd / "shared" / _SUBDIR]
  return list(dict.fromkeys(p.resolve() for p in out))


def googlenet_dir(shared_dir: str | Path | None = None) -> Path:
  """The directory holding the GoogLeNet/K80 logs.

  Raises:
    TraceUnavailableError: none of the candidate directories has the logs (the message lists them).
  """
  tried = _candidate_dirs(shared_dir)
  for d in tried:
    if (d / "tmp8comm.log").is_file():
      return d
  raise TraceUnavailableError(
      "the GoogLeNet/K80 trace (a public data set read at run time, not shipped with the package) is "
      "not on this machine; looked for traces/googlenet-caffe-k80/tmp8comm.log under "
      + ", ".join(str(d) for d in tried)
      + ". Pass shared_dir= (the directory that holds traces/), or use a bundled trace: "
      + ", ".join(_BUNDLED) + ".")


def googlenet_available(shared_dir: str | Path | None = None) -> tuple[bool, str]:
  """(True, directory) when the GoogLeNet logs are here, else (False, the reason): for skipif."""
  try:
    return True, str(googlenet_dir(shared_dir))
  except TraceUnavailableError as e:
    return False, str(e)


def _check_nodes(nodes: int, fn: str) -> int:
  if isinstance(nodes, bool) or nodes not in GOOGLENET_NODES:
    raise ValueError(f"{fn}(nodes={nodes!r}): the GoogLeNet logs exist for {list(GOOGLENET_NODES)} nodes.")
  return int(nodes)


_ROW = re.compile(r"\]\s*\[([^\]]*)\]\s*$")


def _read_pass(nodes: int, shared_dir: str | Path | None) -> np.ndarray:
  """The last 128-row pass of tmp{nodes}comm.log as an array (param_id, numel, compute_us, comm_us)."""
  path = googlenet_dir(shared_dir) / f"tmp{nodes}comm.log"
  rows = []
  for line in path.read_text().splitlines():
    m = _ROW.search(line)
    if m and "distributed.cpp" in line:
      rows.append([float(x) for x in m.group(1).split(",")][:4])
  if len(rows) < 128:
    raise TraceUnavailableError(f"{path}: expected at least one pass of 128 rows, found {len(rows)} rows.")
  last = np.asarray(rows[-128:], dtype=np.float64)
  if not np.array_equal(last[:, 0], np.arange(128)):
    raise TraceUnavailableError(f"{path}: the last 128 rows are not param_ids 0..127 in order; the log "
                                f"is not the expected format.")
  if not np.any(last[:, 2] > 0):
    raise TraceUnavailableError(f"{path}: the last pass has no compute times (all zero).")
  return last


def _googlenet_layers() -> list[tuple[str, int, int]]:
  """(caffe layer name, weight numel, bias numel) of bvlc_googlenet in prototxt (= Caffe param) order."""
  layers = [("conv1/7x7_s2", 7 * 7 * 3 * 64, 64), ("conv2/3x3_reduce", 64 * 64, 64),
            ("conv2/3x3", 3 * 3 * 64 * 192, 192)]

  def inception(name, cin, c1, c3r, c3, c5r, c5, pp):
    return [(f"{name}/1x1", cin * c1, c1), (f"{name}/3x3_reduce", cin * c3r, c3r),
            (f"{name}/3x3", 9 * c3r * c3, c3), (f"{name}/5x5_reduce", cin * c5r, c5r),
            (f"{name}/5x5", 25 * c5r * c5, c5), (f"{name}/pool_proj", cin * pp, pp)]

  def aux(name, cin):
    return [(f"{name}/conv", cin * 128, 128), (f"{name}/fc", 128 * 4 * 4 * 1024, 1024),
            (f"{name}/classifier", 1024 * 1000, 1000)]

  layers += inception("inception_3a", 192, 64, 96, 128, 16, 32, 32)
  layers += inception("inception_3b", 256, 128, 128, 192, 32, 96, 64)
  layers += inception("inception_4a", 480, 192, 96, 208, 16, 48, 64)
  layers += aux("loss1", 512)
  layers += inception("inception_4b", 512, 160, 112, 224, 24, 64, 64)
  layers += inception("inception_4c", 512, 128, 128, 256, 24, 64, 64)
  layers += inception("inception_4d", 512, 112, 144, 288, 32, 64, 64)
  layers += aux("loss2", 528)
  layers += inception("inception_4e", 528, 256, 160, 320, 32, 128, 128)
  layers += inception("inception_5a", 832, 256, 160, 320, 32, 128, 128)
  layers += inception("inception_5b", 832, 384, 192, 384, 48, 128, 128)
  layers.append(("loss3/classifier", 1024 * 1000, 1000))
  return layers


def _googlenet_profile(nodes: int, shared_dir: str | Path | None) -> GradientProfile:
  nodes = _check_nodes(nodes, "load_trace('googlenet-k80', ...)")
  data = _read_pass(nodes, shared_dir)
  layers = _googlenet_layers()
  numel = data[:, 1].astype(np.int64)
  true = np.array([n for _, w, b in layers for n in (w, b)], dtype=np.int64)
  padded = -(-true // 64) * 64  # the log's counts are the true counts rounded up to 64 elements
  if len(true) != 128 or not np.array_equal(numel, padded):
    bad = int(np.flatnonzero(numel != padded)[0]) if len(true) == 128 else 0
    raise TraceUnavailableError(
        f"tmp{nodes}comm.log: row {bad} has {numel[bad]} elements, but bvlc_googlenet's parameter {bad} "
        f"has {true[bad] if len(true) == 128 else '?'} (padded to a multiple of 64: "
        f"{padded[bad] if len(true) == 128 else '?'}); the log is not the expected GoogLeNet trace.")
  bwd_us = data[0::2, 2]  # one time per layer: the weight row's (the bias row repeats it)
  if not np.allclose(bwd_us, data[1::2, 2]):
    raise TraceUnavailableError(f"tmp{nodes}comm.log: a weight and bias row of one layer disagree on "
                                f"the layer's backward time.")
  bwd_s = bwd_us * 1e-6
  ready = np.cumsum(bwd_s[::-1])[::-1]  # backward runs from the last layer to the first
  rows = []
  for i, (name, w, b) in enumerate(layers):
    layer = f"params/{name}"
    fwd = GOOGLENET_FWD_PER_BWD * float(bwd_s[i])
    for leaf, n, f in (("weight", w, fwd), ("bias", b, 0.0)):
      rows.append(ProfileRow(path=f"{layer}/{leaf}", layer=layer, shape=(n,), dtype="float32",
                             nbytes=4 * n, ready_s=float(ready[i]), fwd_s=f))
  notes = (f"Measured per-layer backward times (Caffe, K80, {nodes} nodes): the last 128-row pass of "
           f"tmp{nodes}comm.log from github.com/shyhuai/B-Caffe logdata/ (MG-WFBP, INFOCOM'19). Rows are "
           f"Caffe's learnable tensors in parameter (forward) order named after bvlc_googlenet, shape "
           f"(numel,) with the true count (the log pads counts to multiples of 64), float32. Weight and "
           f"bias rows share one layer time, counted once per layer. "
           f"Backward runs last layer to first; a layer's rows are ready when its backward ends; "
           f"parameter-free layers' time is not in the trace. Forward time is MODELLED as "
           f"{GOOGLENET_FWD_PER_BWD} x each layer's backward time (the trace has none). update_s = 0.")
  return GradientProfile(rows=tuple(rows), forward_s=sum(r.fwd_s for r in rows),
                         backward_s=float(ready[0]), method="measured", model="googlenet",
                         device="k80", notes=notes)


def googlenet_comm_s(nodes: int = 8, *, shared_dir: str | Path | None = None) -> np.ndarray:
  """The measured all-reduce time of each of the 128 rows (seconds) from the same pass of the log.

  The 5-column log (8 nodes) folds most bias all-reduces into the weight row (their time is then 0);
  the 4-column logs (2 and 4 nodes) time every row.
  """
  nodes = _check_nodes(nodes, "googlenet_comm_s")
  return _read_pass(nodes, shared_dir)[:, 3] * 1e-6


def googlenet_allreduce(nodes: int = 8, *, shared_dir: str | Path | None = None,
                        min_bytes: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """(sizes in bytes, seconds) of the OSU MPI all-reduce latency test among `nodes` K80 nodes.

  The logs show two regimes: the time jumps between 8 KiB and 12 KiB (the MPI library switches
  algorithm), so fit an alpha-beta model on the large sizes only, e.g.
  `NetworkModel.fit(*googlenet_allreduce(8, min_bytes=ALGORITHM_SWITCH_BYTES), workers=8)`.

  Args:
    nodes: 2, 4 or 8 (allreduce{nodes}.log; allreduce4.log lacks the 'nodes,' prefix of the others).
    shared_dir: the directory that holds traces/ (default: found from the checkout or the cwd).
    min_bytes: keep only sizes >= this.

  Raises:
    ValueError: nodes not in (2, 4, 8).
    TraceUnavailableError: the logs are not on this machine, or the file has no data rows.
  """
  nodes = _check_nodes(nodes, "googlenet_allreduce")
  path = googlenet_dir(shared_dir) / f"allreduce{nodes}.log"
  sizes, secs = [], []
  for line in path.read_text().splitlines():
    line = line.strip()
    if not line or line.startswith("#"):
      continue
    head, *rest = line.split()
    if len(rest) != 1:
      continue
    if "," in head:
      prefix, head = head.split(",", 1)
      if int(prefix) != nodes:
        raise TraceUnavailableError(f"{path}: a row says {prefix} nodes, expected {nodes}.")
    sizes.append(int(head))
    secs.append(float(rest[0]) * 1e-6)
  if not sizes:
    raise TraceUnavailableError(f"{path}: no 'size latency' rows found.")
  x, y = np.asarray(sizes, dtype=np.int64), np.asarray(secs, dtype=np.float64)
  keep = x >= int(min_bytes)
  return x[keep], y[keep]

