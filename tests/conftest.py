"""Every test sees 8 CPU devices: XLA_FLAGS is set before jax is imported (it reaches child processes).

Hypothesis runs derandomized: the same examples on every run, so CI never fails on a draw that a local
run did not see. Set HYPOTHESIS_PROFILE=explore to draw fresh examples (and more of them).
"""

import os

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("explore", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
