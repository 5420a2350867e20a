"""Bundled traces: `load_trace(name)`, `TRACES`, and the GoogLeNet/K80 trace read at run time.

Pure: numpy and prophet_jax._values._types only, never jax.

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

from prophet_jax._values._errors import NetworkError, TraceUnavailableError
from prophet_jax._values._types import GradientProfile, ProfileRow, is_int
from prophet_jax._values._network import NetworkModel, nonneg_line

__all__ = ["TRACES", "load_trace", "googlenet_allreduce", "googlenet_available", "googlenet_dir",
           "googlenet_comm_s", "GOOGLENET_NODES", "ALGORITHM_SWITCH_BYTES", "fit_allreduce",
           "googlenet_layer_allreduce", "googlenet_network", "googlenet_merged_groups",
           "GOOGLENET_LINE_RATE_BYTES_PER_S"]

_BUNDLED_MODELS = ("resnet50", "vgg16", "bert-base", "gpt2")
_BUNDLED_DEVICES = ("v100", "h100")
_BUNDLED = tuple(f"{m}-{d}" for m in _BUNDLED_MODELS for d in _BUNDLED_DEVICES) + (
    "llama-1b-h100", "llama-8b-h100")         # decoder-only transformers for FSDP planning (bench/fsdp.py)
TRACES: tuple[str, ...] = _BUNDLED + ("googlenet-k80",)

GOOGLENET_NODES = (2, 4, 8)
GOOGLENET_FWD_PER_BWD = 0.5   # the stated forward-time model: forward = half of backward, per layer
ALGORITHM_SWITCH_BYTES = 12288  # the OSU logs jump between 8 KiB and 12 KiB (MPI changes algorithm)
GOOGLENET_LINE_RATE_BYTES_PER_S = 10e9 / 8  # 10 Gbit/s Ethernet, the K80 cluster of MG-WFBP's paper
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
      "the GoogLeNet/K80 trace is for a development checkout only (a public data set read at run time "
      "from ../shared beside the repository, not shipped with the package) and is not on this machine; "
      "looked for traces/googlenet-caffe-k80/tmp8comm.log under "
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


def _read_pass(nodes: int, shared_dir: str | Path | None, *, prefix: str = "tmp{}comm",
               columns: int = 4) -> np.ndarray:
  """The last 128-row pass of `prefix`.log as an array (param_id, numel, compute_us, comm_us[, merged_us]).

  `columns` is how many of the logged columns to return (4, or 5 where the log has a fifth).
  """
  name = prefix.format(nodes) + ".log"
  path = googlenet_dir(shared_dir) / name
  if not path.is_file():
    raise TraceUnavailableError(f"{path} is not on this machine (the other GoogLeNet logs are); the data "
                                f"set looks incomplete.")
  rows = []
  for line in path.read_text().splitlines():
    m = _ROW.search(line)
    if m and "distributed.cpp" in line:
      rows.append([float(x) for x in m.group(1).split(",")])
  if len(rows) < 128:
    raise TraceUnavailableError(f"{path}: expected at least one pass of 128 rows, found {len(rows)} rows.")
  if any(len(r) < columns for r in rows[-128:]):
    raise TraceUnavailableError(f"{path}: expected rows of at least {columns} columns "
                                f"[param_id, numel, compute_us, comm_us, merged_us].")
  last = np.asarray([r[:columns] for r in rows[-128:]], dtype=np.float64)
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



# --------------------------------------------------------------------------------------------------
# Fitting alpha and beta the way the MG-WFBP authors did: from the run's own all-reduces


def fit_allreduce(sizes, seconds, *, workers: int, overlap: bool = True,
                  line_rate_bytes_per_s: float | None = None, reject: float | None = 3.0,
                  name: str = "fit") -> NetworkModel:
  """A ring NetworkModel fitted to measured all-reduces by plain least squares on medians over repeats.

  The measured time of one all-reduce of M bytes is modelled as t = a + b·M, MG-WFBP's cost model, with
  a = 2(P-1)·alpha_s and b = 2(P-1)/P·beta (docs/design.md, "Values"). The fit:

  1. takes the median over the repeats of each message size (a message measured twice counts once, and
     one slow repeat of three does not move it);
  2. fits a and b by ordinary (unweighted) least squares over the sizes, constrained to a, b >= 0;
  3. with `reject`, sets aside the sizes whose time is off the line by more than `reject` robust
     standard deviations of the relative residuals (1.4826 · their median absolute deviation; at least
     10%), fits again on the rest, and repeats until the set is stable (the sizes set aside are not
     weighted, just left out: a message that once took 5x its usual time says nothing about the link);
  4. turns a and b into alpha_s = a / (2(P-1)) and beta = b·P / (2(P-1)).

  Unweighted squares on purpose (docs/facts.md, "Gloo across network namespaces"): small messages now and
  then take several times their usual time, and a fit weighted by relative error lets those outliers pull
  beta below the link's real cost. Plain squares are decided by the large messages, whose times are
  steady, but slow small ones still lift a and so tilt b down (by 2-11% on synthetic runs with a fifth
  of the small messages 5-10x slow, against under 1.2% after step 3). `NetworkModel.fit` weights by
  relative error and is meant for clean probes; use this one for times taken inside a training run. A
  fitted link faster than the line rate means the fit is wrong: give `line_rate_bytes_per_s` and such a
  fit raises.

  Args:
    sizes: message sizes in bytes, one per measurement (sizes may repeat), shape (n,).
    seconds: the measured times: shape (n,), or (n, repeats) with NaN where a repeat is missing.
    workers: P, the number of workers the all-reduces ran among (>= 2).
    overlap: carried into the model (True for GPUs).
    line_rate_bytes_per_s: if given, the fitted link bandwidth 1/beta must not exceed it.
    reject: how many robust standard deviations off the line make a size an outlier (step 3); None to
      keep every size.
    name: the model's name.

  Returns:
    The NetworkModel, with `fit_residual_s` the RMS residual over the per-size medians it kept.

  Raises:
    NetworkError: mismatched shapes, non-finite or negative data, fewer than 2 distinct sizes, workers <
      2, or a fitted bandwidth above `line_rate_bytes_per_s`.

  Examples:
    >>> # 1 ms + 2 ns/B; one slow repeat of the 1 MB message (10 ms) does not move its median
    >>> m = fit_allreduce([1e3, 1e6, 1e6, 1e6, 4e6], [0.001002, 0.003, 0.003, 0.010, 0.009], workers=2)
    >>> round(m.startup_s * 1e3, 6), round(m.per_byte_s * 1e9, 6)    # a (ms), b (ns/B)
    (1.0, 2.0)
  """
  x = np.asarray(sizes, dtype=np.float64)
  y = np.asarray(seconds, dtype=np.float64)
  if y.ndim == 1:
    y = y[:, None]
  if x.ndim != 1 or y.ndim != 2 or y.shape[0] != x.shape[0]:
    raise NetworkError(f"fit_allreduce(): got sizes of shape {x.shape} and seconds of shape {y.shape}; "
                       f"expected (n,) and (n,) or (n, repeats).")
  if not np.all(np.isfinite(x)) or np.any(x < 0) or np.any(y[np.isfinite(y)] < 0) or np.any(np.isinf(y)):
    raise NetworkError("fit_allreduce(): sizes and times must be finite and >= 0 (NaN marks a missing "
                       "repeat).")
  if not is_int(workers) or workers < 2:
    raise NetworkError(f"fit_allreduce(workers={workers!r}): a fit needs an integer number of workers "
                       f">= 2.")
  keep = np.any(np.isfinite(y), axis=1)
  x, y = x[keep], y[keep]
  sizes_u = np.unique(x)
  if len(sizes_u) < 2:
    raise NetworkError(f"fit_allreduce() needs at least 2 distinct message sizes to fit alpha and beta; "
                       f"got sizes {tuple(sizes_u.tolist())}.")
  med = np.array([np.nanmedian(y[x == v]) for v in sizes_u])
  keep = np.ones(len(sizes_u), dtype=bool)
  for _ in range(len(sizes_u)):
    a, b = nonneg_line(sizes_u[keep], med[keep], relative=False)
    if reject is None:
      break
    pred = a + b * sizes_u
    rel = (med - pred) / np.maximum(pred, 1e-300)
    spread = 1.4826 * float(np.median(np.abs(rel[keep] - np.median(rel[keep]))))
    new = np.abs(rel) <= max(reject * spread, 0.1)
    if np.array_equal(new, keep) or np.count_nonzero(new) < 2 or len(np.unique(sizes_u[new])) < 2:
      break
    keep = new
  p = int(workers)
  beta = b * p / (2 * (p - 1))
  if line_rate_bytes_per_s is not None and beta > 0 and 1.0 / beta > line_rate_bytes_per_s:
    raise NetworkError(f"fit_allreduce(): the fitted link bandwidth {1 / beta / 1e6:.0f} MB/s exceeds the "
                       f"line rate {line_rate_bytes_per_s / 1e6:.0f} MB/s, so the fit is wrong (outliers, "
                       f"or times that do not include the whole transfer). Check the data, or fit only "
                       f"the sizes whose times are steady.")
  resid = float(np.sqrt(np.mean((a + b * sizes_u[keep] - med[keep]) ** 2)))
  return NetworkModel(alpha_s=a / (2 * (p - 1)), beta_s_per_byte=beta, workers=p, overlap=overlap,
                      name=name, fit_residual_s=resid)


def googlenet_layer_allreduce(nodes: int = 8, *, shared_dir: str | Path | None = None
                              ) -> tuple[np.ndarray, np.ndarray]:
  """The per-layer all-reduces B-Caffe measured in the same run as the GoogLeNet profile.

  tmp{nodes}comm.log times every all-reduce of the benchmark iteration: the GPU->host copy, the MPI
  all-reduce, the scaling and the copies back (B-Caffe's DistManager::ReduceLoop). In the 8-node log a
  layer's weight and bias went out in one all-reduce, logged on the weight row (the bias row reads 0), so
  a message is a logged row with the zero rows after it; its fifth column re-times the same all-reduces
  in a later iteration, a second repeat. In the 2- and 4-node logs every row is its own all-reduce, one
  repeat. Sizes are the logged (64-element aligned, as B-Caffe sends them) counts times 4 bytes.

  Args:
    nodes: 2, 4 or 8.
    shared_dir: the directory that holds traces/ (default: found from the checkout or the cwd).

  Returns:
    (sizes in bytes, shape (n,)), (seconds, shape (n, repeats)): n = 65 messages and 2 repeats at 8 nodes,
    128 and 1 at 2 and 4.

  Raises:
    ValueError: nodes not in (2, 4, 8).
    TraceUnavailableError: the logs are not on this machine, or not in the expected format.
  """
  nodes = _check_nodes(nodes, "googlenet_layer_allreduce")
  data = _read_pass(nodes, shared_dir, columns=5 if nodes == 8 else 4)
  numel, comm = data[:, 1], data[:, 3:]
  starts = np.flatnonzero(comm[:, 0] > 0)
  if len(starts) == 0 or starts[0] != 0:
    raise TraceUnavailableError(f"tmp{nodes}comm.log: the first row has no all-reduce time; the log is "
                                f"not the expected format.")
  stops = np.r_[starts[1:], len(numel)]
  sizes = np.array([4.0 * numel[a:b].sum() for a, b in zip(starts, stops)])
  seconds = comm[starts] * 1e-6
  seconds[seconds <= 0] = np.nan  # a repeat that was not logged
  return sizes, seconds


def googlenet_network(nodes: int = 8, *, shared_dir: str | Path | None = None,
                      line_rate_bytes_per_s: float | None = GOOGLENET_LINE_RATE_BYTES_PER_S
                      ) -> NetworkModel:
  """The network of the GoogLeNet/K80 trace, fitted as MG-WFBP's authors did: from the run's all-reduces.

  `fit_allreduce` over `googlenet_layer_allreduce(nodes)` (medians over repeats, plain least squares), for
  `nodes` workers, overlapping compute (B-Caffe all-reduces from a thread while backward runs). Fitted on
  the all-reduces of the training run itself, the start-up cost includes what a training all-reduce pays
  beyond MPI (the copies between GPU and host, the synchronisation of the GPUs), which the OSU latency
  test of `googlenet_allreduce` does not see: at 8 nodes a = 2(P-1)·alpha_s is about 1.7 ms here
  against about 0.8 ms from the OSU test, and that start-up cost is what merging saves.

  Args:
    nodes: 2, 4 or 8.
    shared_dir: the directory that holds traces/.
    line_rate_bytes_per_s: the fit must not find a link faster than this (10 Gbit/s Ethernet by
      default, the paper's cluster); None to skip the check.

  Returns:
    A NetworkModel named 'googlenet-k80-fit{nodes}'.

  Raises:
    ValueError: nodes not in (2, 4, 8).
    TraceUnavailableError: the logs are not on this machine.
    NetworkError: the fit finds a link faster than the line rate.
  """
  sizes, seconds = googlenet_layer_allreduce(nodes, shared_dir=shared_dir)
  return fit_allreduce(sizes, seconds, workers=nodes, overlap=True,
                       line_rate_bytes_per_s=line_rate_bytes_per_s, name=f"googlenet-k80-fit{nodes}")


def googlenet_merged_groups(nodes: int = 8, *, shared_dir: str | Path | None = None
                            ) -> tuple[tuple[tuple[int, ...], ...], np.ndarray]:
  """The merged all-reduces of the authors' merged run (tmp{nodes}ocomm.log, 4 or 8 nodes).

  B-Caffe logs a merged all-reduce's time in the fifth column of the first row (lowest parameter index)
  of its group; a group runs from there to the row before the next logged one. Rows are the profile's
  rows (Caffe's parameter order).

  Returns:
    (groups: row indices of each merged all-reduce, in parameter order), (seconds of each, shape (g,)).

  Raises:
    ValueError: nodes not in (4, 8).
    TraceUnavailableError: the logs are not on this machine, or not in the expected format.
  """
  if isinstance(nodes, bool) or nodes not in (4, 8):
    raise ValueError(f"googlenet_merged_groups(nodes={nodes!r}): the merged runs exist for [4, 8] nodes.")
  data = _read_pass(nodes, shared_dir, prefix="tmp{}ocomm", columns=5)
  starts = np.flatnonzero(data[:, 4] > 0)
  if len(starts) == 0 or starts[0] != 0:
    raise TraceUnavailableError(f"tmp{nodes}ocomm.log: the first row has no merged all-reduce time; the "
                                f"log is not the expected format.")
  stops = np.r_[starts[1:], 128]
  groups = tuple(tuple(range(a, b)) for a, b in zip(starts, stops))
  return groups, data[starts, 4] * 1e-6
