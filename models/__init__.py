"""Model definitions, small trainable models and bundled traces (installed as `prophet_jax.models`).

- `get_model(name)`, `MODELS`, `TrainableModel`, `layer_of`, `forward_paths`, `num_params`: the small
  trainable flax models ('mlp', 'cnn', 'gpt-tiny', 'resnet-small'), in `registry.py` [jax].
- `load_trace(name)`, `TRACES`: bundled GradientProfiles ('resnet50-v100', ..., 'googlenet-k80'), and
  `googlenet_allreduce(nodes)`, `googlenet_comm_s(nodes)`, `googlenet_available()`, `googlenet_dir()`,
  `googlenet_layer_allreduce(nodes)`, `googlenet_network(nodes)` (alpha, beta fitted from the run's own
  all-reduces), `googlenet_merged_groups(nodes)` (the authors' merged run), and `fit_allreduce` (the
  robust alpha-beta fit), in `_traces.py` (pure: numpy only).
- `architecture(name)`, `ARCHITECTURES`, `reference_param_count(name)`: flax definitions of ResNet-50,
  VGG-16, BERT-base and GPT-2 small (parameter trees via `jax.eval_shape`; `Architecture.forward_paths`),
  in `zoo.py` [jax].
- `scan.py` (written with the rewrite): a scan-over-layers model whose blocks all-reduce inside the
  backward loop (`prophet_jax.models.scan.scan_model`) [jax].
- `make_traces.py`: the generator of the bundled `{model}-{device}` traces (`python models/make_traces.py`).

Names are imported lazily, so loading a trace does not import jax or flax.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "get_model": "registry", "MODELS": "registry", "TrainableModel": "registry",
    "layer_of": "registry", "forward_paths": "registry", "num_params": "registry",
    "PARAM_DTYPES": "registry",
    "load_trace": "_traces", "TRACES": "_traces", "googlenet_allreduce": "_traces",
    "googlenet_available": "_traces", "googlenet_dir": "_traces", "googlenet_comm_s": "_traces",
    "GOOGLENET_NODES": "_traces", "ALGORITHM_SWITCH_BYTES": "_traces", "fit_allreduce": "_traces",
    "googlenet_layer_allreduce": "_traces", "googlenet_network": "_traces",
    "googlenet_merged_groups": "_traces", "GOOGLENET_LINE_RATE_BYTES_PER_S": "_traces",
    "architecture": "zoo", "ARCHITECTURES": "zoo", "reference_param_count": "zoo",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
  if name in _EXPORTS:
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
  raise AttributeError(f"module 'prophet_jax.models' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
