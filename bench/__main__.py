"""python -m bench [--quick] [--out PATH]: run every benchmark, write BENCHMARKS.md and the plots.

Full mode writes BENCHMARKS.md at the repository root and the plots under docs/bench/. Quick mode
(tiny loads, one repetition; a test runs it) writes to --out, default bench_results/BENCHMARKS.md, with
its plots beside it, so the committed file keeps the full run's numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import shutil
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import (
    broadcast,
    capacity,
    correction,
    handoff,
    overhead,
    pool_step,
    report,
    routing,
    routing_at_scale,
    scaling,
    trainer_ranks,
    training,
)
from bench.common import REPO, machine, vllm_servers, warm_up


@dataclass(frozen=True)
class Plan:
    reps: int
    routing_groups: int
    groups_in_flight: int
    max_tokens: int
    overhead_requests: int
    overhead_concurrency: int
    scaling_groups: int
    handoff_versions: int
    train_steps: int
    train_reps: int
    capacity_upstreams: int
    capacity_connections: int
    capacity_seconds: float
    capacity_many_upstreams: int  # ours again, in front of this many stubs
    broadcast_sizes: tuple[int, ...]  # replicas behind the proxy, the first 1 (the baseline)
    broadcast_versions: int
    scale_routing_replicas: int  # stubs behind each router in the GRPO-shaped comparison at scale
    scale_routing_groups: int
    scale_routing_groups_in_flight: int
    pool_step_delays: tuple[float, ...]  # node-start delays the demand step is simulated with
    correction_steps: int  # steps of each bf16 run of the correction comparison
    correction_seeds: int  # seeds per method; 0 leaves the comparison out
    ranks_reps: int  # repetitions of the trainer-ranks comparison
    ranks_big_model: bool  # its random model ~1 GB (else ~2 MB)


FULL = Plan(
    reps=5, routing_groups=32, groups_in_flight=4, max_tokens=32, overhead_requests=300, overhead_concurrency=4,
    scaling_groups=32, handoff_versions=10, train_steps=30, train_reps=2,
    capacity_upstreams=8, capacity_connections=64, capacity_seconds=5.0, capacity_many_upstreams=256,
    broadcast_sizes=(1, 8, 32, 128, 256), broadcast_versions=10,
    scale_routing_replicas=64, scale_routing_groups=192, scale_routing_groups_in_flight=16,
    pool_step_delays=(30, 120, 300), correction_steps=40, correction_seeds=3, ranks_reps=2, ranks_big_model=True,
)  # fmt: skip
QUICK = Plan(
    reps=1, routing_groups=4, groups_in_flight=2, max_tokens=16, overhead_requests=24, overhead_concurrency=4,
    scaling_groups=4, handoff_versions=3, train_steps=6, train_reps=1,
    capacity_upstreams=4, capacity_connections=16, capacity_seconds=1.5, capacity_many_upstreams=64,
    broadcast_sizes=(1, 8, 32), broadcast_versions=3,
    scale_routing_replicas=8, scale_routing_groups=12, scale_routing_groups_in_flight=4,
    pool_step_delays=(30, 120), correction_steps=6, correction_seeds=0, ranks_reps=1, ranks_big_model=False,
)  # fmt: skip
BENCHMARKS = {  # run in this order, on the same two replicas
    "routing": routing.run,
    "overhead": overhead.run,
    "scaling": scaling.run,
    "handoff": handoff.run,
    "training": training.run,  # sections async_vs_sync and experience, from three runs side by side
    "capacity": capacity.run,  # stubs, not the replicas: the proxy alone
    "broadcast": broadcast.run,  # a fleet of stubs: the proxy alone
    "routing_at_scale": routing_at_scale.run,  # a fleet of stubs with a prefix-cache model
    "pool_step": pool_step.run,  # the real scaling policy, in simulated time
    "correction": correction.run,  # bf16 replicas of its own; nine training runs (not in quick mode)
    "trainer_ranks": trainer_ranks.run,  # spawned trainer ranks, no Ray: 1 vs 2, DDP vs FSDP2
}

# A benchmark that measures several of the report's sections returns them by name.
SECTIONS = {"training": training.SECTIONS}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny loads, one repetition (about 3 minutes)")
    parser.add_argument(
        "--out", type=Path, default=None, help="markdown output (quick default: bench_results/)"
    )
    parser.add_argument(
        "--render", type=Path, default=None, help="rewrite the markdown from a results.json, running nothing"
    )
    parser.add_argument("--only", nargs="*", choices=list(BENCHMARKS), default=None, help="run only these")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="with --only: put these sections into the existing results.json (the others keep their own "
        "run's numbers, each section naming its run) and rewrite the markdown from the whole",
    )
    return parser.parse_args(argv)


async def run_all(plan: Plan, only, work: Path) -> dict:
    from transformers import AutoTokenizer

    from rl_cluster.tiny import ensure_tiny_model

    model_dir = ensure_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    results: dict = {}
    started = time.monotonic()
    async with vllm_servers(model_dir, 2, work) as servers:
        print(
            f"logs under {work}; two vLLM servers healthy after {time.monotonic() - started:.0f}s", flush=True
        )
        await warm_up(servers, tokenizer, str(model_dir))
        for name, bench in BENCHMARKS.items():
            if (only and name not in only) or (name == "correction" and not plan.correction_seeds):
                continue
            t0 = time.monotonic()
            print(f"== {name}", flush=True)
            sections = SECTIONS.get(name, (name,))
            try:
                measured = await bench(servers, model_dir, tokenizer, plan, work / name)
                results.update(measured if name in SECTIONS else {name: measured})
            except Exception as e:  # the other benchmarks still run; the report says what failed
                traceback.print_exc()
                results.update({section: {"error": f"{type(e).__name__}: {e}"} for section in sections})
            print(f"   {name} took {time.monotonic() - t0:.0f}s", flush=True)
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.quick:
        out = (args.out or REPO / "bench_results" / "BENCHMARKS.md").absolute()
        plots_dir = out.parent
    else:
        out = (args.out or REPO / "BENCHMARKS.md").absolute()
        plots_dir = REPO / "docs" / "bench" if args.out is None else out.parent
    if args.render is not None:  # prose changed, numbers did not: keep the run's machine, date and command
        saved = json.loads(args.render.read_text())
        info, command = saved.pop("machine"), saved.pop("command", "python -m bench")
        report.write(out, plots_dir, saved, info, command, quick=saved["plan"]["reps"] == QUICK.reps)
        print(f"wrote {out} from {args.render}")
        return 0
    command = "python -m bench" + "".join(
        f" {shlex.quote(a)}" for a in (argv if argv is not None else sys.argv[1:])
    )
    info = machine()
    started = time.monotonic()
    # Logs of every process the benchmarks start (vLLM, routers, taps, moto), kept for a post-mortem.
    work = out.parent / "logs" if args.quick else REPO / "bench_results" / "logs"
    shutil.rmtree(work, ignore_errors=True)
    results = asyncio.run(run_all(plan, args.only, work))
    results["plan"] = asdict(plan)
    if args.merge:
        results = merged(plots_dir / "results.json", results, info, command)
    # The numbers first: a report that fails to render must not lose them.
    plots_dir.mkdir(parents=True, exist_ok=True)
    (plots_dir / "results.json").write_text(
        json.dumps({"machine": info, "command": command, **results}, indent=1, default=str)
    )
    report.write(out, plots_dir, results, info, command, args.quick)
    failed = [k for k, v in results.items() if isinstance(v, dict) and "error" in v]
    print(
        f"wrote {out} in {time.monotonic() - started:.0f}s"
        + (f"; FAILED: {failed}, logs in {work}" if failed else "")
    )
    return 1 if failed else 0


def merged(saved_path: Path, fresh: dict, info: dict, command: str) -> dict:
    """The sections of an earlier run's results with this run's sections put in; every section carries
    the machine and command of the run that measured it."""
    saved = json.loads(saved_path.read_text())
    old_info, old_command = saved.pop("machine"), saved.pop("command", "python -m bench")
    for key, value in saved.items():
        if isinstance(value, dict) and key != "plan":
            value.setdefault("machine", old_info)
            value.setdefault("command", old_command)
    for key, value in fresh.items():
        if isinstance(value, dict) and key != "plan":
            value.update(machine=info, command=command)
    return {**saved, **fresh}


if __name__ == "__main__":
    sys.exit(main())
