"""Gantt charts of simulated (and measured) iterations: one row per lane, one panel per policy."""

from __future__ import annotations

from collections.abc import Mapping

from ._simulate import SimResult

_COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "update": "#8172B3", "allreduce": "#55A868",
           "reduce_scatter": "#64B5CD", "all_gather": "#CCB974", "measured": "#C44E52"}


def plot_timelines(sims: Mapping[str, SimResult], path: str, *, title: str = "",
                   measured_s: Mapping[str, float] | None = None) -> None:
  """Write a PNG: per policy, the device lane and each link lane over one iteration.

  Args:
    sims: policy name -> SimResult (with events).
    path: output PNG.
    title: figure title.
    measured_s: policy name -> measured median step time, drawn as a bar beside the prediction.
  """
  import matplotlib  # pure module: matplotlib (an optional dependency) only when a plot is drawn

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # after choosing the Agg backend
  from matplotlib.patches import Patch

  names = list(sims)
  lanes_of = {n: sorted({e.lane for e in sims[n].events}, key=lambda x: (x != "device", x)) for n in names}
  heights = [len(lanes_of[n]) + (1 if measured_s and n in measured_s else 0) + 0.6 for n in names]
  fig, axes = plt.subplots(len(names), 1, figsize=(11, 0.9 + 0.55 * sum(heights)), squeeze=False,
                           gridspec_kw={"height_ratios": heights}, sharex=True)
  for ax, n in zip(axes[:, 0], names):
    sim, lanes = sims[n], list(lanes_of[n])
    if measured_s and n in measured_s:
      lanes.append("measured")
    y = {lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}
    for e in sim.events:
      ax.barh(y[e.lane], (e.end_s - e.start_s) * 1e3, left=e.start_s * 1e3, height=0.7,
              color=_COLORS.get(e.kind, "#999999"), edgecolor="white", linewidth=0.3)
    if measured_s and n in measured_s:
      ax.barh(y["measured"], measured_s[n] * 1e3, left=0, height=0.7, color=_COLORS["measured"])
    ax.axvline(sim.iteration_s * 1e3, color="black", linewidth=0.8, linestyle="--")
    ax.set_yticks([y[lane] for lane in lanes], lanes, fontsize=8)
    what = (f"{sim.reduce_scatters} reduce-scatters + {sim.all_gathers} all-gathers" if sim.all_gathers
            else f"{sim.allreduces} all-reduces")
    ax.set_title(f"{n}: predicted {sim.iteration_s * 1e3:.2f} ms, {what}"
                 + (f", measured {measured_s[n] * 1e3:.2f} ms" if measured_s and n in measured_s else ""),
                 fontsize=9, loc="left")
  axes[-1, 0].set_xlabel("ms from the start of backward")
  kinds = {e.kind for n in names for e in sims[n].events}
  shown = [k for k in _COLORS if (k != "measured" or measured_s)            # the sharded kinds if drawn
           and (k in kinds or k not in ("reduce_scatter", "all_gather"))]
  fig.legend(handles=[Patch(color=_COLORS[k], label=k) for k in shown], loc="upper right", ncol=5,
             fontsize=8)
  if title:
    fig.suptitle(title, x=0.01, ha="left", fontsize=10)
  fig.tight_layout(rect=(0, 0, 1, 0.97))
  fig.savefig(path, dpi=110)
  plt.close(fig)
