"""Multi-process runs: start N local processes wired for `jax.distributed`, join them, agree on a plan.

* `launch(cmd, nproc=N, ...)` (also `prophet-jax launch --nproc N -- CMD ...` and
  `python -m prophet_jax.launch --nproc N -- CMD ...`, with the same arguments) starts N copies of CMD
  on this host and waits for them; when one fails it stops the others and returns that one's code.
* `initialize()`, called by the training script before any other jax call, joins the run this
  process belongs to (`jax.distributed.initialize`), failing with a clear `LaunchError` instead of a
  hang when the coordinator is unreachable.
* `broadcast_schedule(schedule, params)`: rank 0's schedule on every process, each checking it against
  its own parameter tree; all fail together when one does not match.

Environment set by `launch` for each process (read through `prophet_jax._values._config`):

  PROPHET_PROCESS_ID      rank of this process, 0 .. N-1
  PROPHET_NUM_PROCESSES   N
  PROPHET_COORDINATOR     'host:port' of the coordinator (rank 0 serves it); default 127.0.0.1 and a
                          free port
  PROPHET_GLOO_INTERFACE  interface gloo binds to (only with --gloo-interface)
  PROPHET_INIT_TIMEOUT_S  seconds to wait for the coordinator (default 60)
  PROPHET_HEARTBEAT_TIMEOUT_S  passed on from the parent: seconds without a heartbeat before
                          jax.distributed declares a process dead (default jax's 100)
  PROPHET_LOCAL_DEVICES   CPU devices of this process (only when the launcher set the count)
  XLA_FLAGS               the parent's, with --xla_force_host_platform_device_count per process
  PYTHONUNBUFFERED=1      so output lines arrive as they are printed

On a real cluster: do not use `launch`. Start one process per host with your scheduler (SLURM, Open
MPI, Kubernetes, Cloud TPU); `initialize()` sees no PROPHET_* process variables and calls
`jax.distributed.initialize()` with no arguments, so jax's own cluster detection finds the
coordinator, the process count and the ranks (JAX_COORDINATOR_ADDRESS also triggers that path).
Without launch and without a cluster, `initialize()` does nothing and the script runs as one process.
The training script is the same in all three cases.
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
