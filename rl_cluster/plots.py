"""curves.png: reward and staleness per step, the two curves that say whether async RL is working, and the
held-out eval (pass@1, mean@k per eval step) when the run made one."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], []
    for v in values:
        acc.append(v)
        acc = acc[-window:]
        out.append(sum(acc) / len(acc))
    return out


def curves_png(history: list[dict], title: str, evals: list[dict] | None = None) -> bytes:
    """`evals`: the run's eval records (rl_cluster.core.evaluation); a third panel when there are any."""
    steps = [r["step"] for r in history if r["reward"] is not None]
    rewards = [r["reward"] for r in history if r["reward"] is not None]
    evals = sorted(evals or [], key=lambda r: r["step"])
    if evals:
        fig, (ax_r, ax_s, ax_e) = plt.subplots(3, 1, figsize=(8, 8.5), sharex=True)
        _eval_panel(ax_e, evals)
    else:
        fig, (ax_r, ax_s) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax_r.plot(steps, rewards, alpha=0.35, label="reward (per step)")
    ax_r.plot(steps, _smooth(rewards, max(1, len(rewards) // 10)), label="reward (moving mean)")
    ax_r.set_ylabel("reward")
    ax_r.legend(loc="lower right")
    ax_r.set_title(title)
    stale = [(r["step"], r["staleness"]) for r in history if r["staleness"] is not None]
    ax_s.plot([s for s, _ in stale], [v for _, v in stale], color="tab:orange", label="mean staleness")
    ax_s.set_ylabel("staleness (versions)")
    ax_s.set_xlabel("" if evals else "optimizer step")
    ax_s.legend(loc="upper left")
    # The version grows with the run; on its own axis it does not flatten the staleness curve.
    ax_v = ax_s.twinx()
    ax_v.plot(
        [r["step"] for r in history], [r["policy_version"] for r in history], color="tab:green", alpha=0.6
    )
    ax_v.set_ylabel("policy version", color="tab:green")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def _eval_panel(ax, evals: list[dict]) -> None:
    steps = [r["step"] for r in evals]
    nan = float("nan")  # an eval whose every request failed has no score: a gap in the line
    ax.plot(steps, [nan if r["pass@1"] is None else r["pass@1"] for r in evals], marker="o",
            label="eval pass@1 (greedy)")  # fmt: skip
    ax.plot(steps, [nan if r["mean@k"] is None else r["mean@k"] for r in evals], marker="s",
            label=f"eval mean@{evals[-1]['k']} (sampled)")  # fmt: skip
    ax.set_ylabel("held-out score")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("optimizer step")
    ax.legend(loc="lower right")
