"""The trainer's callbacks into the run: progress per step, a stop asked for, checkpoints to publish, how
the ranks hold the model."""

from __future__ import annotations

import os
import shutil
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
    whatever the trainer did after the driver's summary would be missing from it). Rank 0 hears the
    stop; every rank ends at the same step (a rank that trained on would wait for the others in its next
    collective for ever), so the flag is all-reduced."""

    def __init__(self, asked: threading.Event, accelerator):
        self.asked = asked
        self.accelerator = accelerator

    def on_step_end(self, args, state, control, **kwargs):
        if any_rank(self.accelerator, self.asked.is_set()):
            control.should_training_stop = True


def any_rank(accelerator, flag: bool) -> bool:
    """Whether `flag` is set on any rank (each rank must ask, at the same point)."""
    if accelerator.num_processes == 1:
        return flag
    import torch

    agreed = accelerator.reduce(torch.tensor(int(flag), device=accelerator.device), reduction="sum")
    return int(agreed.item()) > 0


class CheckpointPublisher(TrainerCallback):
    """Moves each checkpoint the trainer saves locally into the bucket (files, then manifest)."""

    def __init__(self, publish: Callable[[int, str], None]):
        self.publish = publish

    def on_save(self, args, state, control, **kwargs):
        local = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if not os.path.isdir(local):
            return
        if state.is_world_process_zero:
            self.publish(state.global_step, local)
        else:  # another rank's share of the checkpoint (its RNG state) is not kept: rank 0's is
            shutil.rmtree(local, ignore_errors=True)


def held_share(model) -> tuple[int, int]:
    """(bytes of the model's weights this rank holds, bytes of all its weights): all of them under DDP, its
    shard of each under FSDP2."""
    from torch.distributed.tensor import DTensor

    held = whole = 0
    for p in model.parameters():
        whole += p.numel() * p.element_size()
        held += (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
    return held, whole


class ShareReport(TrainerCallback):
    """With several ranks, rank 0 says, once its model is wrapped for them, how much of the model's weights it
    holds: the sign that FSDP2 shards (about 1/N of them) and DDP does not (all of them)."""

    def __init__(self, trainer_config):
        self.strategy, self.ranks = trainer_config.strategy, trainer_config.num_workers

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.ranks > 1 and state.is_world_process_zero and model is not None:
            held, whole = held_share(model)
            print(
                f"trainer ranks: {self.strategy} over {self.ranks}; rank 0 holds {100 * held / whole:.0f}% of the "
                f"model's {whole / 2**20:.1f} MiB of weights",
                flush=True,
            )
