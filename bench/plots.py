"""The PNG plots of BENCHMARKS.md (matplotlib, no display)."""

from __future__ import annotations

from pathlib import Path


def _figure(width: float = 7.0, height: float = 3.2):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(1, 2, figsize=(width, height))


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bars(ax, labels, values, title, fmt="{:.2f}"):
    ax.barh(range(len(values)), values, color="#4878a8")
    ax.set_yticks(range(len(values)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9)
    for i, v in enumerate(values):
        ax.text(v, i, " " + fmt.format(v), va="center", fontsize=7)


def routing(r: dict, path: Path) -> Path:
    plt, fig, (a, b) = _figure(8.5)
    labels = [x["router"] for x in r["rows"]]
    _bars(a, labels, [x["throughput"] for x in r["rows"]], "completions/s", "{:.1f}")
    _bars(
        b,
        labels,
        [100 * x["cache_hit_rate"] for x in r["rows"]],
        "replica prefix-cache hit rate (%)",
        "{:.0f}",
    )
    b.set_yticks([])
    return _save(plt, fig, path)


def overhead(r: dict, path: Path) -> Path:
    plt, fig, (a, b) = _figure()
    labels = [f"{x['path']}, {x['load']}" if "load" in x else x["path"] for x in r["rows"]]
    _bars(a, labels, [x["p50_ms"] for x in r["rows"]], "p50 latency (ms)", "{:.1f}")
    _bars(b, labels, [x["p99_ms"] for x in r["rows"]], "p99 latency (ms)", "{:.1f}")
    b.set_yticks([])
    return _save(plt, fig, path)


def handoff(r: dict, path: Path) -> Path:
    plt, fig, (a, b) = _figure(8.5)
    rows = [x for x in r["rows"] if "routable_s" in x or "load_s" in x]
    labels = [x["path"].split(",")[0] for x in rows]
    key = [("routable_s" if "routable_s" in x else "load_s") for x in rows]
    _bars(
        a, labels, [x[k]["p50_ms"] for x, k in zip(rows, key, strict=True)], "to routable, p50 (ms)", "{:.0f}"
    )
    _bars(
        b, labels, [x[k]["p95_ms"] for x, k in zip(rows, key, strict=True)], "to routable, p95 (ms)", "{:.0f}"
    )
    b.set_yticks([])
    return _save(plt, fig, path)


def scaling(r: dict, path: Path) -> Path:
    plt, fig, (a, b) = _figure()
    labels = [f"{x['generators']} generator(s)" for x in r["rows"]]
    _bars(a, labels, [x["throughput"] for x in r["rows"]], "completions/s", "{:.1f}")
    _bars(b, labels, [x["speedup_vs_1"] for x in r["rows"]], "speedup vs 1", "{:.2f}x")
    b.set_yticks([])
    return _save(plt, fig, path)


def async_vs_sync(r: dict, path: Path) -> Path:
    plt, fig, (a, b) = _figure(8.5)
    for label, curve in r["curves"].items():
        a.plot([t for t, _ in curve], [rew for _, rew in curve], label=label, lw=1)
    a.set_xlabel("seconds since step 1", fontsize=8)
    a.set_title("reward per step", fontsize=9)
    a.legend(fontsize=7)
    labels = [x["mode"].split(" ")[0] for x in r["rows"]]
    _bars(b, labels, [x["steps_per_hour"] for x in r["rows"]], "steps/hour", "{:.0f}")
    return _save(plt, fig, path)


def broadcast(r: dict, path: Path) -> Path:
    plt, fig, (a, b) = _figure()
    n = [x["replicas"] for x in r["rows"]]
    a.plot(n, [1000 * x["p50_s"] for x in r["rows"]], "o-", label="p50")
    a.plot(n, [1000 * x["max_s"] for x in r["rows"]], "s--", label="max")
    a.axhline(r["load_ms"], color="grey", lw=0.8, ls=":", label="one replica's load")
    a.set(xscale="log", xlabel="replicas", title="sync: load on every replica (ms)")
    a.legend(fontsize=7)
    b.plot(n, [x["vs_one_replica"] for x in r["rows"]], "o-")
    b.set(xscale="log", xlabel="replicas", title="p50 vs one replica")
    for ax in (a, b):
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
    return _save(plt, fig, path)


def routing_at_scale(r: dict, path: Path) -> Path:
    plt, fig, (a, b) = _figure(8.5)
    labels = [x["router"] for x in r["rows"]]
    _bars(
        a,
        labels,
        [100 * x["cache_hit_rate"] for x in r["rows"]],
        "engine prefix-cache hit rate (%)",
        "{:.0f}",
    )
    _bars(b, labels, [x["requests_max_over_mean"] for x in r["rows"]], "busiest / mean requests (1 = even)")
    b.set_yticks([])
    return _save(plt, fig, path)


def pool_step(r: dict, path: Path) -> Path:
    plt, fig, (a, b) = _figure()
    load = r["load"]
    for x in r["rows"]:
        t = [p[0] for p in x["timeline"]]
        a.step(t, [p[1] for p in x["timeline"]], where="post", label=f"node start {x['node_start_s']:.0f} s")
        b.step(t, [p[2] for p in x["timeline"]], where="post")
    for ax, title in ((a, "replicas (started and starting)"), (b, "replicas serving")):
        ax.axvspan(load["before_s"], load["before_s"] + load["during_s"], color="grey", alpha=0.12)
        ax.set(xlabel="seconds", title=title)
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
    a.legend(fontsize=7)
    return _save(plt, fig, path)


def correction(r: dict, path: Path) -> Path:
    """Reward per step (mean over seeds) of each method, and the share of tokens each corrected."""
    plt, fig, (a, b) = _figure(8.5)
    for row in r["rows"]:
        curves = [run["rewards"] for run in r["runs"] if run["method"] == row["method"]]
        steps = min(len(c) for c in curves)
        mean = [sum(c[i] or 0.0 for c in curves) / len(curves) for i in range(steps)]
        a.plot(range(1, steps + 1), mean, label=row["method"])
    a.set_xlabel("step", fontsize=8)
    a.set_title(f"reward, mean of {r['config']['seeds']} seeds (bf16)", fontsize=9)
    a.legend(fontsize=7)
    _bars(b, [x["method"] for x in r["rows"]], [x["share_corrected"] for x in r["rows"]],
          "share of tokens truncated or masked", "{:.2%}")  # fmt: skip
    return _save(plt, fig, path)


def draw_all(results: dict, plots_dir: Path) -> dict[str, Path]:
    drawers = {
        "routing": routing,
        "overhead": overhead,
        "handoff": handoff,
        "scaling": scaling,
        "async_vs_sync": async_vs_sync,
        "broadcast": broadcast,
        "routing_at_scale": routing_at_scale,
        "pool_step": pool_step,
        "correction": correction,
    }
    return {
        key: draw(results[key], plots_dir / f"{key}.png")
        for key, draw in drawers.items()
        if key in results and "error" not in results[key]
    }
