"""A run's checkpoints as the trainer uses them: published with the run's record (until the run stops),
the newest verified one found for a resume, and the restart of a trainer by Ray told as a fault."""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
import time
from datetime import datetime
from pathlib import Path

from rl_cluster.bucket import Bucket
from rl_cluster.config import RunConfig
from rl_cluster.core.fence import WriteFence
from rl_cluster.core.manifest import adapter_dir_name

RUN_STATE = "rl_cluster_state.json"  # in each checkpoint: the run's record up to it


def publish_checkpoint(
    bucket: Bucket, config: RunConfig, step: int, local_dir: str, state: dict, base_fingerprint: str,
    stopping: threading.Event | None = None,
) -> tuple[str, list[int]]:  # fmt: skip
    """TRL's checkpoint directory of `step`, with the run's record `state` beside TRL's files (what a resume
    restores besides TRL's), into the bucket; then retention, unless `stopping` was set meanwhile (the
    run's summary may be written already: nothing it lists is deleted after it). Returns (its URI, the
    steps retention deleted). The local directory goes: the bucket holds it now."""
    (Path(local_dir) / RUN_STATE).write_text(json.dumps(state))
    uri = bucket.publish_checkpoint(
        config.run_name, step, local_dir, base_model=config.model.path, base_fingerprint=base_fingerprint
    )
    shutil.rmtree(local_dir, ignore_errors=True)
    if stopping is not None and stopping.is_set():
        return uri, []
    deleted = bucket.apply_checkpoint_retention(config.run_name, keep_last=config.trainer.keep_checkpoints)
    return uri, deleted


class KeptCheckpoints:
    """The checkpoints this life of the trainer published and retention still keeps, until stop(): after it
    none is published, so a stopped run's summary lists what the bucket keeps (before it, a trainer that
    went on after the driver's report published one and retention deleted a listed one; CI saw it). A
    publication under way longer than stop() waits completes without retention: the bucket then keeps one
    checkpoint the summary does not list, and deletes none it lists."""

    STOP_WAIT_S = 15.0  # within the driver's 20 s for stop() (rl_cluster.run.REPORT_TIMEOUT_S)

    def __init__(self, bucket: Bucket, config: RunConfig, fence: WriteFence):
        self.bucket, self.config, self.fence = bucket, config, fence
        self.uris: list[str] = []
        self.stopping = threading.Event()  # set by stop(); training ends at the step's end (StopWhenAsked)
        self._publishing = threading.Lock()

    def publish(self, step: int, local_dir: str, state: dict, base_fingerprint: str) -> str | None:
        """publish_checkpoint, and the list updated; None (nothing published) once stopping."""
        with self._publishing:
            if self.stopping.is_set():
                return None
            if not self.fence.admits(f"publish checkpoint {step}"):
                return None
            uri, deleted = publish_checkpoint(
                self.bucket, self.config, step, local_dir, state, base_fingerprint, stopping=self.stopping
            )
            gone = {self.bucket.checkpoint_uri(self.config.run_name, step) for step in deleted}
            self.uris = [kept for kept in self.uris if kept not in gone] + [uri]
            return uri

    def stop(self) -> None:
        """No checkpoint starts after this; one being published completes first, or within STOP_WAIT_S
        (an upload of a large model takes minutes), then goes on without retention."""
        self.stopping.set()
        if self._publishing.acquire(timeout=self.STOP_WAIT_S):
            self._publishing.release()


def newest_checkpoint(
    bucket: Bucket, config: RunConfig, base_fingerprint: str, required: bool
) -> tuple[str | None, int | None]:
    """(local directory, step) of the newest checkpoint of this run that verifies against its manifest.
    A damaged one is quarantined (out of the listing, retention and the way of the step's next
    publication) and the one before it is tried; one that does not fit (another base model) is skipped
    but left alone: the run's config may be what is wrong."""
    from rl_cluster.errors import AdapterNotFound, AdapterRejected, FilesDiffer

    run = config.run_name
    for step in reversed(bucket.list_checkpoints(run)):
        try:
            local = bucket.fetch_checkpoint(
                bucket.checkpoint_uri(run, step),
                cache_dir=config.bucket.cache_dir,
                base_fingerprint=base_fingerprint,
            )
        except FilesDiffer as e:
            where = bucket.quarantine_checkpoint(run, step)
            print(f"checkpoint step {step} is damaged ({e}): moved to {where}; trying the one before",
                  flush=True)  # fmt: skip
            continue
        except (AdapterRejected, AdapterNotFound) as e:
            print(f"checkpoint step {step} is not usable ({e}); trying the one before", flush=True)
            continue
        return str(local), step
    if required:
        raise RuntimeError(
            f"{bucket.run_uri(run)} holds no verified checkpoint to resume from: run with "
            "trainer.checkpoint_every > 0 to make some, or start a new run"
        )
    return None, None


def resume_line(restarted: bool, step: int | None, published: list[int]) -> str:
    """What a resuming trainer prints: from which checkpoint (`step`; None: none yet), after which version."""
    return (
        ("trainer restarted by Ray: " if restarted else "")
        + (f"resuming from checkpoint step {step}" if step is not None else "no checkpoint yet: from step 0")
        + f"; versions continue after v{max(published, default=0)}"
    )


def read_state(checkpoint: str) -> dict:
    """The run's record saved with a checkpoint (publish_checkpoint's `state`)."""
    return json.loads((Path(checkpoint) / RUN_STATE).read_text())


def restart_fault(bucket: Bucket, run_name: str, published: list[int], step: int | None) -> dict:
    """A trainer's restart by Ray as a fault: since the dead trainer's last sign of life (its newest
    published version, by its manifest's time; now when it published none), until the first step the new
    life trains (`recovered_s`, filled in then). `step`: the checkpoint it resumes from."""
    began = time.time()
    if published:
        with contextlib.suppress(Exception):  # a missing or odd manifest: the restart's own time
            name = adapter_dir_name(run_name, max(published))
            manifest = json.loads(bucket.read_text(run_name, f"adapters/{name}/manifest.json"))
            began = datetime.fromisoformat(manifest["created_at"]).timestamp()
    what = f"trainer restarted by Ray ({f'from checkpoint step {step}' if step else 'from step 0'})"
    return {"time": round(began, 3), "what": what, "who": "trainer", "recovered_s": None}
