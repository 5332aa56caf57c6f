"""One small PNG per scenario: every system side by side on shared axes (matplotlib, Agg backend, no display).

Top row: each user request's TTFT from its first send (retries included) against the time it was first sent,
one colour per class; a request that got no first token is a cross at the time its user waited (censored).
Bottom row: each replica's KV cache usage over time. Faults are dotted vertical lines. X axes are scenario
seconds. The figures are committed (docs/benchmarks.md shows them), so they are kept small: one column per
system, 60 dpi, a handful of colours.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.scenarios.base import RunData, Scenario  # noqa: E402

ORDER = ("envoy-rr", "envoy-tuned", "smg", "sluice")


def plot_scenario(sc: Scenario, runs: dict[str, RunData], path: Path) -> Path:
    systems = [s for s in ORDER if s in runs] + [s for s in runs if s not in ORDER]
    fig, axes = plt.subplots(2, len(systems), figsize=(3.2 * len(systems), 4.6), sharex=True, sharey="row",
                             squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    classes: dict[str, str] = {}
    for col, system in enumerate(systems):
        run = runs[system]
        ts = run.time_scale
        top, bottom = axes[0][col], axes[1][col]
        for call in run.calls():
            cls = sc.call_class(call, run)
            colour = classes.setdefault(cls, colours[len(classes) % len(colours)])
            if call.ttft is not None:
                top.plot(call.first_send * ts, call.ttft * ts, ".", ms=2, color=colour)
            else:
                top.plot(call.first_send * ts, call.waited * ts, "x", ms=3, color=colour)
        top.axhline(sc.slo_ttft_s, color="black", linewidth=0.6, linestyle="--")
        top.set_yscale("symlog", linthresh=0.1)
        top.set_title(system, fontsize=9)
        for i, addr in enumerate(run.replicas):
            ss = run.samples.get(addr, [])
            bottom.plot([x["t"] * ts for x in ss], [x.get("kv") or 0.0 for x in ss], linewidth=0.8,
                        label=f"replica {i}")
        bottom.set_ylim(0, 1.05)
        bottom.set_xlabel("scenario time (s)", fontsize=8)
        for ev in run.events:
            for ax in (top, bottom):
                ax.axvline(ev["t"] * ts, color="grey", linestyle=":", linewidth=0.7)
        for ax in (top, bottom):
            ax.tick_params(labelsize=7)
    axes[0][0].set_ylabel("TTFT from first send (s)", fontsize=8)
    axes[1][0].set_ylabel("KV usage", fontsize=8)
    handles = [plt.Line2D([], [], marker="o", linestyle="", color=c, ms=4, label=k) for k, c in classes.items()]
    handles.append(plt.Line2D([], [], marker="x", linestyle="", color="black", ms=4, label="no token (censored)"))
    handles.append(plt.Line2D([], [], linestyle="--", color="black", linewidth=0.6, label=f"SLO {sc.slo_ttft_s:g} s"))
    fig.legend(handles=handles, loc="upper center", ncol=min(8, len(handles)), fontsize=7, frameon=False)
    fig.suptitle(f"{sc.id} {sc.title}", fontsize=9, y=0.995, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=60)
    plt.close(fig)
    return path
