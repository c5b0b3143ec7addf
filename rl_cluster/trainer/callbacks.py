"""The trainer's callbacks into the run: progress per step, a stop asked for, checkpoints to publish."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from transformers import TrainerCallback

from rl_cluster.trainer.compat import is_step_log


class StepReporter(TrainerCallback):
    """Hands each step's logged metrics to a function (TRL's progress bar does not reach Ray job logs)."""

    def __init__(self, report: Callable[[int, dict], None]):
        self.report = report

    def on_log(self, args, state, control, logs=None, **kwargs):
        if is_step_log(logs):
            self.report(state.global_step, dict(logs))


class StopWhenAsked(TrainerCallback):
    """Ends training at the end of the step under way once `asked` is set (the driver is stopping the run:
    whatever the trainer did after the driver's summary would be missing from it)."""

    def __init__(self, asked: threading.Event):
        self.asked = asked

    def on_step_end(self, args, state, control, **kwargs):
        if self.asked.is_set():
            control.should_training_stop = True


class CheckpointPublisher(TrainerCallback):
    """Moves each checkpoint the trainer saves locally into the bucket (files, then manifest)."""

    def __init__(self, publish: Callable[[int, str], None]):
        self.publish = publish

    def on_save(self, args, state, control, **kwargs):
        local = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(local):
            self.publish(state.global_step, local)
