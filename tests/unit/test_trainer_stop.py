"""Stopping the trainer: a run that ends early reports exactly the checkpoints the bucket keeps. Before,
the trainer went on training after the driver's report, and a checkpoint published then (retention
deleting the oldest) left summary.json listing one that was gone (CI's Ctrl-C'd chaos run)."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

from transformers import TrainerControl

import rl_cluster.trainer.checkpoints as checkpoints_module
from rl_cluster.bucket import Bucket
from rl_cluster.config import load_config
from rl_cluster.core.fence import WriteFence
from rl_cluster.trainer.callbacks import StopWhenAsked
from rl_cluster.trainer.checkpoints import KeptCheckpoints

CONFIG = Path(__file__).resolve().parents[2] / "jobs" / "configs" / "cpu_demo.toml"


def _held() -> WriteFence:
    fence = WriteFence(margin_s=15, first_news_s=0)
    fence.renewed(60)
    return fence


def test_stop_waits_for_the_checkpoint_being_published_and_none_is_published_after_it(tmp_path, monkeypatch):
    bucket = Bucket(str(tmp_path / "bucket"))
    kept = KeptCheckpoints(
        bucket, load_config(CONFIG, ["run_name=stopping", f"bucket.uri={tmp_path}"]), _held()
    )
    publishing, release, published = threading.Event(), threading.Event(), []

    def publish(bucket, config, step, local_dir, state, fingerprint, stopping=None):  # retention keeps two
        if step == 15:
            publishing.set()
            release.wait(10)
        published.append(step)
        return bucket.checkpoint_uri(config.run_name, step), [step - 10] if step > 10 else []

    monkeypatch.setattr(checkpoints_module, "publish_checkpoint", publish)
    for step in (5, 10):
        kept.publish(step, "/nowhere", {}, "")
    under_way = threading.Thread(target=kept.publish, args=(15, "/nowhere", {}, ""))
    under_way.start()
    assert publishing.wait(10)
    stopping = threading.Thread(target=kept.stop)
    stopping.start()
    stopping.join(0.3)
    assert stopping.is_alive()  # waits for the publish under way
    release.set()
    under_way.join(10)
    stopping.join(10)
    assert kept.stopping.is_set()

    assert kept.publish(20, "/nowhere", {}, "") is None  # the step under way saves one more: not published
    assert published == [5, 10, 15]
    assert kept.uris == [bucket.checkpoint_uri("stopping", s) for s in (10, 15)]  # step 5: deleted


def test_training_ends_at_the_step_end_once_stop_was_asked():
    asked = threading.Event()
    callback, control = StopWhenAsked(asked, SimpleNamespace(num_processes=1)), TrainerControl()  # one rank
    callback.on_step_end(None, None, control)
    assert not control.should_training_stop
    asked.set()
    callback.on_step_end(None, None, control)
    assert control.should_training_stop


def test_a_fenced_trainer_publishes_no_checkpoint_and_deletes_nothing(tmp_path):
    """The lease ran out (a frozen driver) or was lost: a checkpoint is refused before any file is
    written, and retention deletes nothing the successor may hold."""
    bucket = Bucket(str(tmp_path / "bucket"))
    config = load_config(CONFIG, ["run_name=fenced", f"bucket.uri={tmp_path}", "trainer.keep_checkpoints=1"])
    local = tmp_path / "checkpoint-5"
    local.mkdir()
    (local / "trainer_state.json").write_text("{}")
    refused: list[str] = []
    fence = _held()
    fence.on_refused = refused.append
    kept = KeptCheckpoints(bucket, config, fence)
    assert kept.publish(5, str(local), {}, "") == bucket.checkpoint_uri("fenced", 5)
    fence.lost("lease.json is now held by host b, pid 7")
    local.mkdir()
    (local / "trainer_state.json").write_text("{}")
    # Not raised mid-step (the other ranks would wait in a collective): handed on, and nothing published.
    assert kept.publish(10, str(local), {}, "") is None
    assert bucket.list_checkpoints("fenced") == [5]  # nothing published, retention deleted nothing
    assert (
        len(refused) == 1
        and "refuses to publish checkpoint 10: the driver lost the run's lease" in refused[0]
    )


def test_a_publication_longer_than_stop_waits_goes_on_without_retention(tmp_path, monkeypatch):
    """A checkpoint of a large model uploads for minutes; the driver waits 20 s for stop(). stop() returns
    within its bound, the upload completes, and retention deletes nothing the summary may list."""
    bucket = Bucket(str(tmp_path / "bucket"))
    config = load_config(CONFIG, ["run_name=slow", f"bucket.uri={tmp_path}", "trainer.keep_checkpoints=1"])
    kept = KeptCheckpoints(bucket, config, _held())
    monkeypatch.setattr(KeptCheckpoints, "STOP_WAIT_S", 0.2)
    for step in (5, 10):
        local = tmp_path / f"checkpoint-{step}"
        local.mkdir()
        (local / "trainer_state.json").write_text("{}")
    kept.publish(5, str(tmp_path / "checkpoint-5"), {}, "")
    uploading, release = threading.Event(), threading.Event()
    real = bucket.publish_checkpoint

    def slow(*args, **kwargs):
        uploading.set()
        release.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(bucket, "publish_checkpoint", slow)
    under_way = threading.Thread(target=kept.publish, args=(10, str(tmp_path / "checkpoint-10"), {}, ""))
    under_way.start()
    assert uploading.wait(10)
    kept.stop()  # returns after its bound, the upload still under way
    assert under_way.is_alive()
    release.set()
    under_way.join(10)
    assert bucket.list_checkpoints("slow") == [5, 10]  # keep_checkpoints=1, yet step 5 was not deleted
