"""When a rollout group may start: admission that follows the trainer.

A sample is consumed when the trainer pulls it, and dropped as stale if the trainer's policy version is
then more than `window` versions past the group's. Pulls happen in order, so "when will this group be
consumed" has an exact answer in *positions* rather than seconds: the trainer pulls `samples_per_step`
samples per optimizer step and moves the version every `sync_every` steps. When version v becomes current
with `pulled` samples pulled so far, the samples it may still consume without dropping a group that
starts under v are those up to position

    limit = pulled + (window + 1) * sync_every * samples_per_step

(the steps until version v + window + 1 is published). A group of G samples started under v is
admitted only while every sample admitted before it plus its own G fit under that limit. Groups are
consumed roughly in admission order, but not exactly: a group with one slow sample is overtaken by
groups admitted after it. The asynchronous limit keeps `slack` positions (half a step) for that; a
demo run without it dropped 4.6 % of its groups, all right after a step that waited for a straggler.

`window` is `max_staleness` for the asynchronous trainer. The lockstep baseline (`trainer.mode =
"sync"`) uses window 0: the samples of the next `sync_every` steps are generated only after the sync
that precedes them, so none is ever stale.

Pure logic: no Ray, vLLM, torch or HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdmissionWindow:
    samples_per_step: int
    """Samples the trainer pulls per optimizer step (completions_per_step)."""
    sync_every: int
    """Optimizer steps between version changes."""
    window: int
    """Versions a sample may lag behind the trainer when pulled (max_staleness; 0 for lockstep)."""
    slack: int = 0
    """Positions kept free for groups that finish out of admission order (asynchronous only: lockstep
    must admit exactly the next steps' samples, or the trainer waits for samples never started)."""

    def __post_init__(self) -> None:
        if self.samples_per_step < 1 or self.sync_every < 1 or self.window < 0:
            raise ValueError(f"impossible admission window {self}")
        if not 0 <= self.slack <= self.window * self.sync_every * self.samples_per_step:
            raise ValueError(f"slack {self.slack} would starve the trainer: {self}")

    def limit(self, pulled: int) -> int:
        """The admission limit, in pull positions, set when a new version becomes current after `pulled`
        samples were pulled.

        >>> AdmissionWindow(samples_per_step=32, sync_every=1, window=2).limit(pulled=64)
        160
        >>> AdmissionWindow(samples_per_step=32, sync_every=4, window=0).limit(pulled=128)
        256
        >>> AdmissionWindow.for_trainer(32, 8, sync_every=1, max_staleness=2, lockstep=False).limit(pulled=64)
        144
        """
        return pulled + (self.window + 1) * self.sync_every * self.samples_per_step - self.slack

    @classmethod
    def for_trainer(
        cls, samples_per_step: int, group_size: int, sync_every: int, max_staleness: int, lockstep: bool
    ) -> AdmissionWindow:
        """The window of a run: max_staleness versions with half a step (in whole groups) of slack, or
        the lockstep window."""
        if lockstep or max_staleness == 0:
            return cls(samples_per_step, sync_every, window=0)
        slack = max(group_size, samples_per_step // 2 // group_size * group_size)
        return cls(samples_per_step, sync_every, window=max_staleness, slack=slack)


def admits(admitted: int, group_size: int, limit: int) -> bool:
    """Whether a group of `group_size` samples may start, with `admitted` samples admitted before it.

    >>> admits(admitted=152, group_size=8, limit=160), admits(admitted=153, group_size=8, limit=160)
    (True, False)
    """
    return admitted + group_size <= limit
