"""Several processes: jax.distributed set-up, the launcher, agreement, the Monitor."""
