"""Compile-only GPU targets: XLA:GPU's whole pipeline on a machine without a GPU (docs/gpu.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import importlib.util
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from .._values._checks import check_int
from ._jaxcompat import private
from .._values._errors import GpuCompileError, JaxVersionError

# name -> (file under prophet_jax/targets, aliases)
_TARGETS: dict[str, tuple[str, tuple[str, ...]]] = {
    "h100": ("h100_sxm.txtpb", ("h100-sxm", "h100_sxm", "h100-80gb")),
    "a100": ("a100_sxm_80.txtpb", ("a100-sxm", "a100_sxm_80", "a100-sxm-80gb", "a100-80gb")),
    "v100": ("v100.txtpb", ("v100-sxm2", "v100-sxm2-16gb")),
}
GPU_TARGETS: tuple[str, ...] = tuple(_TARGETS)
# the CUDA majors whose compiler builds for each target: CUDA 13 compiles for compute capability 7.5 and
# newer (it dropped Maxwell, Pascal and Volta), so the V100 (7.0) needs CUDA 12
CUDA_MAJORS: dict[str, tuple[int, ...]] = {"h100": (12, 13), "a100": (12, 13), "v100": (12,)}
# CUDA major -> (the extra, its pip line at jaxlib's version {v}, the ptxas wheel)
_EXTRAS: dict[int, tuple[str, str, str]] = {
    12: ("gpu-compile", "pip install jax-cuda12-plugin=={v} jax-cuda12-pjrt=={v} nvidia-cuda-nvcc-cu12",
         "nvidia-cuda-nvcc-cu12"),
    13: ("gpu-compile-cuda13", "pip install jax-cuda13-plugin=={v} jax-cuda13-pjrt=={v} nvidia-cuda-nvcc",
         "nvidia-cuda-nvcc"),
}
GPU_COMPILE_EXTRA = ("pip install 'prophet-jax[gpu-compile]' for CUDA 12 (or: {cuda12}), or "
                     "'prophet-jax[gpu-compile-cuda13]' for CUDA 13 (or: {cuda13})")
_PLATFORMS_FIX = ("set JAX_PLATFORMS=cpu in the environment before Python starts, or call "
                  "jax.config.update('jax_platforms', 'cpu') before the first jax operation")
# lines the CUDA plugin's libraries print on load where no driver is installed (absl, before logging is
# initialised; no environment variable silences them)
_STUB_NOISE = re.compile(r"cudart_stub\.cc:\d+\] Could not find cuda drivers|All log messages before "
                         r"absl::InitializeLog\(\) is called are written to STDERR")


# --------------------------------------------------------------------------------------------------
# targets (pure)


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuTarget:
  """A GPU target description shipped with prophet_jax (`prophet_jax/targets/*.txtpb`, as XLA reads it)."""

  name: str
  description: str
  file: str
  compute_capability: str
  core_count: int
  fpus_per_core: int
  clock_ghz: float
  memory_bandwidth_bytes_per_s: float
  config: str = dataclasses.field(repr=False)

  @property
  def peak_flops(self) -> float:
    """FP32 CUDA-core peak FLOP/s: cores x FP32 lanes x 2 (an FMA) x clock."""
    return self.core_count * self.fpus_per_core * 2 * self.clock_ghz * 1e9

  def roofline_s(self, flops: float, nbytes: float) -> float:
    """An op's roofline estimate, seconds: max(flops / peak_flops, nbytes / memory bandwidth)."""
    return max(flops / self.peak_flops, nbytes / self.memory_bandwidth_bytes_per_s)


def _field(text: str, name: str, default: str = "") -> str:
  m = re.search(rf"^\s*{name}:\s*\"?([^\"\n]*)\"?\s*$", text, re.MULTILINE)
  return m.group(1).strip() if m else default


def _resolve(name: str) -> str:
  if not isinstance(name, str):
    raise TypeError(f"gpu target: expected a name such as 'h100', got {type(name).__name__}.")
  key = name.strip().lower()
  for target, (_, aliases) in _TARGETS.items():
    if key == target or key in aliases:
      return target
  raise ValueError(f"unknown GPU target {name!r}; prophet_jax ships {list(GPU_TARGETS)} (aliases: "
                   f"{sorted(a for _, al in _TARGETS.values() for a in al)}). Use one of them, or pass "
                   f"your own GpuTargetConfigProto text to jax.experimental.topologies.get_topology_desc.")


@functools.lru_cache(maxsize=None)
def gpu_target(name: str) -> GpuTarget:
  """The shipped description of GPU target `name` ('h100', 'a100', 'v100' or an alias); ValueError if unknown."""
  key = _resolve(name)
  file = _TARGETS[key][0]
  text = (resources.files("prophet_jax") / "targets" / file).read_text()
  cc = text.split("cuda_compute_capability", 1)[-1]   # the block's major, and its minor (before its '}')
  major, minor = _field(cc, "major", "0"), _field(cc.split("}", 1)[0], "minor", "0")
  return GpuTarget(
      name=key, description=_field(text, "device_description_str"), file=file,
      compute_capability=f"{major}.{minor}", core_count=int(_field(text, "core_count")),
      fpus_per_core=int(_field(text, "fpus_per_core")), clock_ghz=float(_field(text, "clock_rate_ghz")),
      memory_bandwidth_bytes_per_s=float(_field(text, "memory_bandwidth")), config=text)


# --------------------------------------------------------------------------------------------------
# what a compile-only build needs


@dataclass(frozen=True, slots=True)
class CudaPlugin:

  major: int
  plugin: str
  pjrt: str


def _find_spec(module: str) -> Any:
  try:
    return importlib.util.find_spec(module)
  except (ImportError, ValueError):
    return None


def _plugins_found() -> tuple[int, ...]:
  return tuple(major for major in sorted(_EXTRAS) if _find_spec(f"jax_plugins.xla_cuda{major}") is not None)


def cuda_plugin() -> CudaPlugin | None:
  found = _plugins_found()
  if len(found) > 1:
    raise GpuCompileError("both jax-cuda12-plugin and jax-cuda13-plugin are installed; jax loads one "
                          "platform 'cuda', so keep one: pip uninstall jax-cuda12-plugin jax-cuda12-pjrt "
                          "(to keep CUDA 13) or pip uninstall jax-cuda13-plugin jax-cuda13-pjrt (to keep "
                          "CUDA 12).")
  if not found:
    return None
  return CudaPlugin(major=found[0], plugin=f"jax-cuda{found[0]}-plugin", pjrt=f"jax-cuda{found[0]}-pjrt")


def cuda_plugin_installed() -> bool:
  return bool(_plugins_found())


def _version(dist: str) -> str | None:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def find_ptxas() -> str | None:
  m = re.search(r"--xla_gpu_cuda_data_dir=(\S+)", os.environ.get("XLA_FLAGS", ""))
  dirs = [m.group(1)] if m else []
  specs = [_find_spec(module) for module in ("nvidia.cuda_nvcc", "nvidia.cu13")]   # the nvcc wheels
  dirs += [d for spec in specs if spec is not None for d in spec.submodule_search_locations or []]
  dirs += [os.environ[k] for k in ("CUDA_HOME", "CUDA_PATH", "CUDA_DIR") if os.environ.get(k)]
  for d in dirs + ["/usr/local/cuda"]:
    p = Path(d) / "bin" / "ptxas"
    if p.is_file() and os.access(p, os.X_OK):
      return str(p)
  return shutil.which("ptxas")


def _check_requirements(target: str) -> CudaPlugin:
  import jaxlib  # lazy: pure until a topology is made

  want = jaxlib.__version__
  plugin = cuda_plugin()
  if plugin is None:
    lines = {f"cuda{major}": line.format(v=want) for major, (_, line, _) in _EXTRAS.items()}
    raise GpuCompileError(f"gpu_topology: jax's CUDA plugin (jax-cuda12-plugin or jax-cuda13-plugin, "
                          f"XLA:GPU's compiler) is not installed. Install it: {GPU_COMPILE_EXTRA.format(**lines)}.")
  extra, line, nvcc = _EXTRAS[plugin.major]
  for dist in (plugin.plugin, plugin.pjrt):
    got = _version(dist)
    if got is None:
      raise GpuCompileError(f"gpu_topology: {dist} is not installed. Install it: pip install "
                            f"'prophet-jax[{extra}]' (or: {line.format(v=want)}).")
    if got != want:
      raise GpuCompileError(f"gpu_topology: {dist} is {got} but jaxlib is {want}; they must match. "
                            f"Install: pip install {dist}=={want}.")
  if plugin.major not in CUDA_MAJORS[target]:
    spec = gpu_target(target)
    ok = " or ".join(str(m) for m in CUDA_MAJORS[target])
    raise GpuCompileError(
        f"gpu_topology({target!r}): the installed CUDA plugin is {plugin.plugin} (CUDA {plugin.major}), "
        f"which cannot compile for the {spec.description} (compute capability {spec.compute_capability}): "
        f"CUDA 13 dropped Volta and older GPUs. Compile for it with CUDA {ok}: pip uninstall "
        f"{plugin.plugin} {plugin.pjrt} && pip install 'prophet-jax[{_EXTRAS[CUDA_MAJORS[target][0]][0]}]'; "
        f"or pick a target CUDA {plugin.major} supports: "
        f"{[t for t in GPU_TARGETS if plugin.major in CUDA_MAJORS[t]]}.")
  if find_ptxas() is None:
    raise GpuCompileError(f"gpu_topology: no ptxas found (XLA:GPU compiles PTX with it; without it every "
                          f"compile fails with 'No PTX compilation provider is available'). Install it: "
                          f"pip install {nvcc} (CUDA {plugin.major}, as {plugin.plugin}), or put a CUDA "
                          f"toolkit's bin/ on PATH (or set CUDA_HOME).")
  return plugin


def xla_option_accepted(name: str, value: Any) -> bool:
  import jax  # lazy: pure until a topology is made
  import jax.numpy as jnp

  try:
    jax.jit(lambda x: x + 1).lower(jnp.zeros(2, jnp.float32)).compile(compiler_options={name: value})
  except Exception as e:  # noqa: BLE001 - jaxlib raises its own runtime error type
    if "No such compile option" in str(e) or "not a valid" in str(e):
      return False
    raise
  return True


def _check_platforms() -> None:
  import jax  # lazy: pure until a topology is made

  value = jax.config.jax_platforms
  if [p.strip() for p in (value or "").split(",") if p.strip()] != ["cpu"]:
    got = f"JAX_PLATFORMS={value!r}" if value else "JAX_PLATFORMS is not set"
    raise GpuCompileError(
        f"gpu_topology: {got}, so jax initialises its CUDA plugin, which needs a GPU driver, and will "
        f"not make a compile-only CUDA topology ('topology not implemented for cuda'). A compile-only "
        f"build needs jax on the CPU alone: {_PLATFORMS_FIX}.")


# --------------------------------------------------------------------------------------------------
# the topology


@dataclass(frozen=True, eq=False)
class GpuTopology:
  """Compile-only devices of one target (`gpu_topology`): they compile, they never run."""

  target: GpuTarget
  devices: tuple[Any, ...]

  def mesh(self, axis_name: str = "data") -> Any:
    """A one-axis `jax.sharding.Mesh` over the devices, for `jax.shard_map(..., mesh=...)`."""
    from jax.sharding import Mesh  # lazy: pure until a topology is made

    if not isinstance(axis_name, str) or not axis_name:
      raise TypeError(f"GpuTopology.mesh: `axis_name` must be a non-empty string, got {axis_name!r}.")
    return Mesh(self.devices, (axis_name,))

  def abstract(self, tree: Any, spec: Any, *, mesh: Any = None, axis_name: str | None = None) -> Any:
    """`tree` as ShapeDtypeStructs placed with PartitionSpec `spec`: the arguments of `lower(...)`.

    Args:
      tree, spec: a pytree of arrays or ShapeDtypeStructs; a PartitionSpec for every leaf, or a pytree of them.
      mesh, axis_name: the mesh; default a one-axis mesh over the devices on `axis_name` (default: `spec`'s axis).

    Raises:
      TypeError: a spec that is not a PartitionSpec; ValueError: `spec` names axes the mesh lacks.

    Example:
      >>> batch = topo.abstract(batch, P("dp"))     # placed on topo.mesh("dp")
    """
    from ._devices import placed, spec_axes  # imports jax: this module stays pure until a topology is made

    named = spec_axes(spec, "GpuTopology.abstract")
    return placed(tree, spec, mesh, default=lambda: self.mesh(_one_axis(named, axis_name)))

  def __repr__(self) -> str:
    return f"GpuTopology({self.target.name}: {len(self.devices)} x {self.target.description}, compile-only)"


def _one_axis(named: tuple[str, ...], axis_name: str | None) -> str:
  if axis_name is not None:
    other = [a for a in named if a != axis_name]
    if other:
      raise ValueError(f"GpuTopology.abstract(spec=..., axis_name={axis_name!r}): the spec names axis "
                       f"{other[0]!r}, which a mesh of the one axis {axis_name!r} lacks. Pass "
                       f"axis_name={other[0]!r}, or mesh= the mesh the step maps over (topo.mesh(...)).")
    return axis_name
  if len(named) > 1:
    raise ValueError(f"GpuTopology.abstract(spec=...): the spec names the axes {list(named)}; the "
                     f"topology's own mesh has one axis. Pass mesh= a jax.sharding.Mesh over topo.devices "
                     f"with those axes.")
  return named[0] if named else "data"


def gpu_topology(target: str = "h100", *, devices: int = 8) -> GpuTopology:
  """Compile-only devices of a GPU target, on a machine with or without a GPU (docs/gpu.md).

  Args:
    target: 'h100', 'a100' or 'v100' (`GPU_TARGETS`); devices: GPUs in the data-parallel group (one host).

  Returns:
    A GpuTopology: lower a step over `topo.mesh(axis)` on `topo.abstract(...)` values, then compile it.

  Raises:
    ValueError: an unknown target or device count; GpuCompileError: what to install or set (JAX_PLATFORMS=cpu).

  Example:
    >>> topo = prophet_jax.gpu_topology("h100", devices=8)       # JAX_PLATFORMS=cpu
    >>> f = jax.jit(jax.shard_map(step, mesh=topo.mesh("data"), in_specs=(P(), P("data")), out_specs=P()))
    >>> compiled = f.lower(topo.abstract(params, P()), topo.abstract(batch, P("data"))).compile()
  """
  spec = gpu_target(target)
  check_int("gpu_topology", "devices", devices, lo=1, fix="It is a number of GPUs, e.g. 8.")
  _check_requirements(spec.name)
  _check_platforms()
  return _make_topology(spec.name, devices)


@functools.lru_cache(maxsize=None)
def _make_topology(name: str, devices: int) -> GpuTopology:
  from jax.experimental import topologies  # lazy: pure until a topology is made

  spec = gpu_target(name)
  try:
    topo = topologies.get_topology_desc(f"prophet-{name}", "cuda", target_config=spec.config,
                                        topology=f"1x1x{devices}")
  except Exception as e:  # jaxlib raises its own runtime errors: name the target and the fix
    raise GpuCompileError(f"gpu_topology({name!r}, devices={devices}): XLA could not make the compile-only "
                          f"topology: {type(e).__name__}: {e}. Check that the CUDA plugin (jax-cuda12-plugin "
                          f"or jax-cuda13-plugin) matches jaxlib and that JAX_PLATFORMS=cpu.") from e
  return GpuTopology(target=spec, devices=tuple(topo.devices))


@contextlib.contextmanager
def quiet_cuda_stub() -> Iterator[None]:
  try:
    sys.stderr.flush()
    saved = os.dup(2)
  except (OSError, ValueError):
    yield
    return
  with tempfile.TemporaryFile(mode="w+b") as tmp:
    os.dup2(tmp.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      tmp.seek(0)
      kept = [line for line in tmp.read().decode(errors="replace").splitlines(keepends=True)
              if not _STUB_NOISE.search(line)]
      if kept:
        sys.stderr.write("".join(kept))
        sys.stderr.flush()


def import_jax_quietly() -> None:
  with quiet_cuda_stub():
    import jax  # noqa: F401 - imported inside the stub: the point of this function

    try:
      register = private("jax._src.xla_bridge", "_discover_and_register_pjrt_plugins",
                         feature="the command line's quiet start")
    except JaxVersionError:
      return
    register()

