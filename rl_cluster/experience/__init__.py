"""The experience store: every sample the trainer pulled (trained, or dropped as stale), kept in the bucket
as Parquet shards, to audit a run afterwards or replay it offline (`python -m rl_cluster.experience`).

The trainer calls `ExperienceWriter.add` on its training thread for each sample it pulls; that only turns
the sample into a row (rl_cluster.core.experience has the columns) and buffers it. Once `shard_groups`
groups are complete (all `num_generations` samples in), those rows go to one background thread that
writes the Parquet file and publishes it as a committed shard (files first, manifest last). The store is
a record, not part of training: an error there is printed once, counted in `stats()`, and never raised
into the trainer, and a shard that finds the writer still busy with `max_pending` others is dropped
rather than make training wait.

`load_experience` reads a run's shards back as one `datasets.Dataset`, each file verified against its
manifest first.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rl_cluster.bucket import Bucket
from rl_cluster.core.experience import COLUMNS, SHARD_FILE, Sample, new_segment, sample_row

__all__ = ["ExperienceWriter", "load_experience", "rows_table"]


def rows_table(rows: list[dict[str, Any]]):
    """Rows as a `pyarrow.Table` with the store's schema. `rewards` is a struct of the reward functions
    the rows name (Parquet cannot hold a struct without fields, so without any the column is left out)."""
    import pyarrow as pa  # here, not at import: `python -m rl_cluster.experience --help` stays instant

    arrow = {
        "string": pa.string(),
        "int64": pa.int64(),
        "bool": pa.bool_(),
        "float64": pa.float64(),
        "list<int32>": pa.list_(pa.int32()),
        "list<int8>": pa.list_(pa.int8()),
        "list<float32>": pa.list_(pa.float32()),
    }
    funcs = sorted({name for row in rows for name in row["rewards"]})
    fields = []
    for name, kind in COLUMNS.items():
        if name == "rewards":
            if funcs:
                fields.append(pa.field(name, pa.struct([(f, pa.float64()) for f in funcs])))
        else:
            fields.append(pa.field(name, arrow[kind]))
    schema = pa.schema(fields)
    return pa.Table.from_pylist(rows, schema=schema)


class ExperienceWriter:
    """Buffers rows on the caller's thread; writes and publishes shards on one background thread."""

    def __init__(
        self,
        bucket: Bucket,
        run_name: str,
        adapter_name: str,
        *,
        num_generations: int,
        shard_groups: int = 64,
        segment: str | None = None,
        max_pending: int = 2,
    ):
        if num_generations < 1 or shard_groups < 1:
            raise ValueError(
                f"num_generations={num_generations} and shard_groups={shard_groups} must be >= 1"
            )
        self.bucket = bucket
        self.run_name = run_name
        self.adapter_name = adapter_name
        self.num_generations = num_generations
        self.shard_groups = shard_groups
        self.segment = segment or new_segment()
        self._rows: list[dict[str, Any]] = []  # buffered, in pull order
        self._buffered: dict[int, int] = {}  # group_id -> its samples in the buffer
        self._complete = 0  # groups in the buffer with all their samples
        self._seq = 0
        self._closed = False
        self._queue: queue.Queue[tuple[int, list[dict[str, Any]], int] | None] = queue.Queue(max_pending)
        self._lock = threading.Lock()  # guards what both threads touch: the counters and `_reported`
        self._stats = {"shards": 0, "groups": 0, "rows": 0, "bytes": 0, "failed_shards": 0, "lost_rows": 0}
        self._reported = False
        self._thread = threading.Thread(target=self._run, name="experience-writer", daemon=True)
        self._thread.start()

    def add(
        self, sample: Sample, *, trainer_version: int, trained: bool, pulled_at: float | None = None
    ) -> None:
        """Record one pulled sample (`trained` False: dropped as stale). Cheap; never raises for a bad
        sample or a failing bucket (reported once instead)."""
        if self._closed:
            raise RuntimeError("ExperienceWriter.add after close()")
        try:
            row = sample_row(
                sample,
                segment=self.segment,
                adapter_name=self.adapter_name,
                trainer_version=trainer_version,
                trained=trained,
                pulled_at=time.time() if pulled_at is None else pulled_at,
            )
        except Exception as e:
            self._lose(1, f"a sample of group {getattr(sample, 'group_id', '?')} could not be made a row", e)
            return
        self._rows.append(row)
        group = row["group_id"]
        self._buffered[group] = self._buffered.get(group, 0) + 1
        if self._buffered[group] == self.num_generations:
            self._complete += 1
            if self._complete >= self.shard_groups:
                self._flush(everything=False)

    def close(self, timeout: float = 60.0) -> dict[str, int]:
        """Write what is buffered (incomplete groups too), wait up to `timeout` s for the writer thread,
        and return `stats()`."""
        if self._closed:
            return self.stats()
        self._closed = True
        deadline = time.monotonic() + timeout
        if self._rows:
            self._flush(everything=True, deadline=deadline)
        with contextlib.suppress(queue.Full):  # the thread is a daemon: it goes with the process
            self._queue.put(None, timeout=max(0.0, deadline - time.monotonic()))
        self._thread.join(max(0.0, deadline - time.monotonic()))
        stats = self.stats()
        if self._thread.is_alive():
            print(
                f"experience store: still writing shards after {timeout:.0f}s; giving up on them",
                file=sys.stderr,
            )
        if stats["failed_shards"] or stats["lost_rows"]:
            print(
                f"experience store: {stats['lost_rows']} rows were not stored ({stats['failed_shards']} "
                f"shards failed); {stats['shards']} shards, {stats['rows']} rows are in {self._where()}",
                file=sys.stderr,
            )
        return stats

    def stats(self) -> dict[str, int]:
        """Published so far: shards, groups, rows, bytes (Parquet); and failed_shards, lost_rows."""
        with self._lock:
            return dict(self._stats)

    # ---------------------------------------------------------------- internals

    def _flush(self, *, everything: bool, deadline: float | None = None) -> None:
        """Hand the complete groups (all groups: `everything`) to the writer thread as one shard."""
        complete = {g for g, n in self._buffered.items() if n >= self.num_generations}
        # Groups that stay incomplete (a sample without a trained token is never queued) go out once
        # there are as many of them as a shard holds, so the buffer stays bounded.
        take = (
            set(self._buffered)
            if everything or len(self._buffered) - len(complete) >= self.shard_groups
            else complete
        )
        rows = [r for r in self._rows if r["group_id"] in take]
        self._rows = [r for r in self._rows if r["group_id"] not in take]
        for group in take:
            del self._buffered[group]
        self._complete = 0
        seq, self._seq = self._seq, self._seq + 1
        try:
            if deadline is None:
                self._queue.put_nowait((seq, rows, len(take)))
            else:
                self._queue.put((seq, rows, len(take)), timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            self._lose(
                len(rows), f"shard {seq} was dropped: {self._queue.maxsize} shards were still being written"
            )

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            seq, rows, groups = item
            try:
                size = self._write(seq, rows, groups)
            except Exception as e:
                with self._lock:
                    self._stats["failed_shards"] += 1
                self._lose(len(rows), f"shard {seq} ({len(rows)} rows) could not be written", e)
                continue
            with self._lock:
                for key, n in (("shards", 1), ("groups", groups), ("rows", len(rows)), ("bytes", size)):
                    self._stats[key] += n

    def _write(self, seq: int, rows: list[dict[str, Any]], groups: int) -> int:
        import pyarrow.parquet as pq

        with tempfile.TemporaryDirectory(prefix="rl_cluster-experience-") as tmp:
            path = Path(tmp) / SHARD_FILE
            pq.write_table(rows_table(rows), path, compression="zstd")
            self.bucket.publish_experience_shard(
                self.run_name, seq, self.segment, path, rows=len(rows), groups=groups
            )
            return path.stat().st_size

    def _where(self) -> str:
        return f"{self.bucket.run_uri(self.run_name)}/experience"

    def _lose(self, rows: int, what: str, error: BaseException | None = None) -> None:
        """Count rows that will not be stored; print the first such event, with what to do."""
        with self._lock:
            self._stats["lost_rows"] += rows
            first, self._reported = not self._reported, True
        if first:
            cause = f": {type(error).__name__}: {error}" if error is not None else ""
            print(
                f"experience store: {what}{cause}. Training goes on without those rows. Check that "
                f"{self._where()} is reachable and writable (or set experience.enabled = false); later "
                "losses are only counted (ExperienceWriter.stats(), and a line at close).",
                file=sys.stderr,
                flush=True,
            )


def load_experience(bucket: Bucket, run_name: str, *, cache_dir: str | Path = ".cache/bucket"):
    """Every committed shard of a run as one `datasets.Dataset`, oldest trainer process first; each file is
    verified against its manifest first (AdapterRejected names a corrupted one). s3 buckets are copied
    into `cache_dir`. FileNotFoundError when the run has no shard yet."""
    import datasets

    shards = bucket.list_experience_shards(run_name)
    if not shards:
        raise FileNotFoundError(
            f"no experience shards in {bucket.run_uri(run_name)}/experience (is experience.enabled on, and "
            "has the trainer pulled its first shard_groups groups?)"
        )
    files = [
        str(
            bucket.fetch_experience_shard(
                bucket.experience_shard_uri(run_name, seq, segment), cache_dir=cache_dir
            )
        )
        for seq, segment in shards
    ]
    return datasets.load_dataset("parquet", data_files=files, split="train")
