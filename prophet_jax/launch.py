"""Multi-process runs: start N local processes wired for `jax.distributed`, join them, agree on a plan.

* `launch(cmd, nproc=N, ...)` (also `prophet-jax launch --nproc N -- CMD ...` and `python -m
  prophet_jax.launch --nproc N -- CMD ...`) starts N copies of CMD on this host and waits for them; when one
  fails it stops the others and returns that one's code.
* `initialize()`, called by the training script before any other jax call, joins the run this process
  belongs to (`jax.distributed.initialize`), with a clear `LaunchError` instead of a hang.
* `broadcast_schedule(schedule, params)`: rank 0's schedule on every process, each checking it against its
  own parameter tree; all fail together when one does not match.

`launch` sets the PROPHET_* variables of docs/design.md ("Environment variables") in each process. On a
cluster (SLURM, Open MPI, Kubernetes, Cloud TPU) start one process per host with its scheduler instead:
`initialize()` then lets jax's own cluster detection find the run; alone, it does nothing. The training
script is the same in all three cases (docs/design.md, "Several processes").
"""

from ._multiprocess._agreement import broadcast_schedule as broadcast_schedule
from ._multiprocess._distributed import initialize as initialize
from ._values._errors import LaunchError as LaunchError
from ._multiprocess._launcher import launch as launch
from ._multiprocess._launcher import main as main

__all__ = ["launch", "initialize", "broadcast_schedule", "LaunchError"]

if __name__ == "__main__":
  import sys

  sys.exit(main())
