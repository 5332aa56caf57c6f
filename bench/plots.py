"""PNG plots of one (scenario, system) run: TTFT over time, and each replica's KV usage and queues over time.

matplotlib with the Agg backend (no display). X axes are scenario seconds since the run started.
"""

from __future__ import annotations

from pathlib import Path
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.scenarios.base import RunData, Scenario  # noqa: E402


def plot_run(sc: Scenario, run: RunData, path: Path) -> Path:
    ts = run.time_scale
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    ax = axes[0]
    kinds: dict[str, list[tuple[float, float]]] = {}
    rejected: list[float] = []
    failed: list[float] = []
    for r in run.records:
        if r.ttft is not None:
            kinds.setdefault(r.kind, []).append((r.start * ts, r.ttft * ts))
        elif 400 <= r.status < 600:
            rejected.append(r.start * ts)
        elif not r.cancelled:
            failed.append(r.start * ts)
    for kind, pts in sorted(kinds.items()):
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=6, label=kind, alpha=0.7)
    if rejected:
        ax.scatter(rejected, [0] * len(rejected), marker="x", s=10, color="red", label="HTTP error (4xx/5xx)")
    if failed:
        ax.scatter(failed, [0] * len(failed), marker="|", s=20, color="black", label="timeout / conn error")
    ax.set_ylabel("TTFT (s)")
    ax.set_yscale("symlog", linthresh=0.1)
    ax.legend(loc="upper left", fontsize=7, ncol=4)
    ax.set_title(f"{sc.id} {sc.title}: {run.system} (scenario seconds, time_scale {ts:g})", fontsize=10)
    for ev in run.events:
        for a in axes:
            a.axvline(ev["t"] * ts, color="grey", linestyle=":", linewidth=0.8)
        ax.annotate(f"{ev['fault']}", (ev["t"] * ts, 0), fontsize=6, rotation=90, va="bottom")
    for i, addr in enumerate(run.replicas):
        ss = run.samples.get(addr, [])
        t = [x["t"] * ts for x in ss]
        axes[1].plot(t, [x.get("kv") or 0.0 for x in ss], label=f"r{i} {addr}", linewidth=1)
        line = axes[2].plot(t, [x.get("waiting") or 0 for x in ss], label=f"r{i} waiting", linewidth=1)
        axes[2].plot(t, [x.get("running") or 0 for x in ss], linestyle="--", linewidth=0.8,
                     color=line[0].get_color(), label=f"r{i} running")
    axes[1].set_ylabel("KV usage")
    axes[1].set_ylim(0, 1.05)
    axes[1].legend(loc="upper left", fontsize=7, ncol=4)
    axes[2].set_ylabel("requests")
    axes[2].set_xlabel("scenario time (s)")
    axes[2].legend(loc="upper left", fontsize=7, ncol=4)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
