"""Weights & Biases logging of a run: every optimizer step's record, the evals, the config and the summary.

A thin wrapper over one wandb run, made by the trainer actor on its training thread. The W&B step is the
optimizer step. The run's W&B id is its run name, so a trainer that Ray restarts from a checkpoint logs
into the same W&B run (`resume="allow"`); W&B keeps history steps increasing, so the steps the restarted
trainer repeats are dropped there, and the first attempt's values stay.

The default is offline: the run is written under `<dir>/wandb/offline-run-*` (no account, no network) and
uploaded later with `wandb sync <sync_dir>`. The settings suit a Ray actor's worker thread: no console
capture (it would redirect the whole worker's stdout), and a stop from the W&B UI does not send SIGINT to
the process's main thread (wandb's default), which in a Ray worker is Ray's own loop.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from rl_cluster.config import RunConfig
from rl_cluster.core.telemetry import finite


def flat_scalars(record: dict, prefix: str = "") -> dict:
    """The numbers, booleans and strings of a nested dict, keys joined with `/`; NaN, None and lists are
    left out.

    >>> flat_scalars({"a": 1, "b": {"c": 2.5, "d": None, "e": [1]}, "f": "x", "g": float("nan")})
    {'a': 1, 'b/c': 2.5, 'f': 'x'}
    """
    out = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_scalars(value, f"{name}/"))
        elif isinstance(value, bool | str) or (isinstance(value, int | float) and math.isfinite(value)):
            out[name] = value
    return out


def _numbers(record: dict, prefix: str) -> dict[str, float]:
    """`record`'s finite numbers (not its `step`), each key under `prefix`."""
    return {
        f"{prefix}{k}": v for k, value in record.items() if k != "step" and (v := finite(value)) is not None
    }


class WandbLog:
    """One run's W&B logging; with `logging.wandb = "off"` every method does nothing."""

    def __init__(self, config: RunConfig, default_dir: str | Path | None = None) -> None:
        """`default_dir`: where wandb writes when `logging.wandb_dir` is unset (None: the working directory).
        Raises RuntimeError, saying what to set, when wandb cannot start (online without an API key)."""
        self.run = None
        settings = config.logging
        if settings.wandb == "off":
            return
        # Before the import: wandb's console lines (banner, integration hints, run history) are noise beside
        # the step lines; the run's place is printed once, below or by the trainer at the end.
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        root = Path(settings.wandb_dir or default_dir or ".").resolve()
        root.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(
                mode=settings.wandb,
                project=settings.wandb_project,
                entity=settings.wandb_entity,
                dir=str(root),
                name=config.run_name,
                id=config.run_name,
                resume="allow",
                reinit="create_new",
                config=config.model_dump(mode="json"),  # SecretStr fields dump as "**********"
                settings=wandb.Settings(console="off", silent=True, stop_fn=self._ignore_stop),
            )
        except Exception as e:
            raise RuntimeError(
                f'wandb.init failed (logging.wandb = "{settings.wandb}"): {str(e).rstrip(".")}. Set logging.wandb = "off" or '
                "\"offline\", or set WANDB_API_KEY in the driver's or the trainer node's environment to log online."
            ) from e
        if settings.wandb == "online":
            print(f"wandb run: {self.run.url}", flush=True)

    @staticmethod
    def _ignore_stop() -> None:
        print(
            "wandb: a stop from the W&B UI is ignored; stop the run with Ctrl+C or `ray job stop`", flush=True
        )

    @property
    def sync_dir(self) -> Path | None:
        """The run's local directory (`wandb sync` uploads it); None when logging is off."""
        return Path(self.run.settings.sync_dir) if self.run else None

    def log_step(self, step: int, record: dict) -> None:
        """One optimizer step's record (rl_cluster.core.summary.step_record), its numbers under `train/`."""
        if self.run:
            self.run.log(_numbers(record, "train/"), step=step)

    def log_eval(self, record: dict) -> None:
        """One eval record (rl_cluster.core.evaluation.eval_record), its numbers under `eval/` at its step."""
        if self.run:
            self.run.log(_numbers(record, "eval/"), step=record["step"])

    def finish(self, summary: dict) -> None:
        """Write the run's summary (rl_cluster.core.summary.summarize) into the W&B summary, flattened, and
        finish the run (marked failed unless its status is `finished`); wandb's service process exits."""
        if not self.run:
            return
        import wandb

        self.run.summary.update(flat_scalars(summary))
        self.run.finish(exit_code=0 if summary.get("status", "finished") == "finished" else 1)
        wandb.teardown()


def start_wandb(config: RunConfig, bucket) -> WandbLog:
    """The run's W&B log. Offline runs land beside the run's files when the bucket is a directory every node
    mounts, else under the trainer's .cache/ (beside the vLLM logs), never loose in the working directory."""
    local = Path(".cache", "wandb", config.run_name).resolve()
    log = WandbLog(config, local if bucket.is_remote else bucket.run_uri(config.run_name))
    if log.sync_dir:
        print(f"wandb ({config.logging.wandb}): {log.sync_dir}", flush=True)
    return log
