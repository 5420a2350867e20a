"""Small hand-computed instances shared by the simulator and bound tests."""

from prophet_jax import Bucket, Chunk, GradientProfile, NetworkModel, Schedule


def row(path, layer, elems, ready, fwd=0.0, update=0.0, dtype="float32"):
  isz = 2 if dtype == "bfloat16" else 4
  return dict(path=path, layer=layer, shape=(elems,), dtype=dtype, nbytes=elems * isz, ready_s=ready,
              fwd_s=fwd, update_s=update)


def sched(profile, groups):
  """A schedule from chunks given as lists of whole rows (issue order = list order)."""
  chunks = tuple(Chunk(slices=tuple((r, 0, profile.rows[r].size) for r in g), dtype=profile.rows[g[0]].dtype)
                 for g in groups)
  return Schedule(buckets=tuple(Bucket(chunks=(c,)) for c in chunks), rows=profile.tree_rows())


# Two layers. A (priority first): 250 f32 = 1000 B, ready at the end of backward (3.0), fwd 1.0,
# update 0.1. B: 500 f32 = 2000 B, ready 1.0, fwd 0.5, update 0.2. backward 3.0, forward 1.5, update 0.3.
PROFILE = GradientProfile.from_rows(
    [row("A/w", "A", 250, 3.0, fwd=1.0, update=0.1), row("B/w", "B", 500, 1.0, fwd=0.5, update=0.2)],
    forward_s=1.5, backward_s=3.0)
# P=2 workers: start-up a = 2(P-1) alpha = 0.5 s; per byte b = 2(P-1)/P beta = 0.001 s.
# d(A) = 0.5 + 1.0 = 1.5; d(B) = 0.5 + 2.0 = 2.5; d(A+B) = 0.5 + 3.0 = 3.5.
NET = NetworkModel(alpha_s=0.25, beta_s_per_byte=0.001, workers=2)
