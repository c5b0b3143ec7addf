"""The MATH path on a CPU, end to end: the tiny MATH-format task written as parquet, loaded through
`datasets` and prepared into the bucket (`python -m rl_cluster.data prepare`), a short run of
jobs/configs/cpu_math.toml on the tiny model warm-started on it (rl_cluster.tiny, `task="math"`), graded by
math_reward, with held-out evals through the proxy: eval pass@1 after the run beats pass@1 at step 0."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from cluster.browser import RAY_TOKEN_COOKIE, browser
from cluster.prometheus import panel_queries, plot_range, prometheus, query, query_range
from prometheus_client.parser import text_string_to_metric_families

from rl_cluster.data.tiny_math import write_task

REPO = Path(__file__).resolve().parents[2]
RUN = "e2e-math"
STEPS = 20
EXPORT = re.compile(r"^Ray metrics \(.*\): http://[^:]+:(\d+)/metrics", re.M)
DASHBOARD = re.compile(r"^Ray dashboard: (http://\S+)", re.M)
# Where the screenshots and the PromQL plot land, for README's pictures (docs/img/ holds copies).
PICTURES = REPO / ".cache" / "pictures"
REWARD = f'max(ray_rl_trainer_reward{{run=~"{RUN}"}})'


def eval_metric(run: subprocess.Popen, log: Path, timeout_s: float = 300) -> dict[str, float]:
    """`ray_rl_trainer_eval` of this run by score, from the local Ray's metrics export, once it has both."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and run.poll() is None:
        time.sleep(3)
        if not (port := EXPORT.search(log.read_text(errors="replace"))):
            continue
        try:
            page = (
                urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/metrics", timeout=10)
                .read()
                .decode()
            )
        except OSError:
            continue
        found = {
            sample.labels["score"]: sample.value
            for family in text_string_to_metric_families(page)
            for sample in family.samples
            if sample.name == "ray_rl_trainer_eval" and sample.labels.get("run") == RUN
        }
        if len(found) == 2:
            return found
    raise AssertionError(f"no ray_rl_trainer_eval of {RUN} in the metrics export:\n{log.read_text()[-3000:]}")


def discovery_file(log: Path, run: subprocess.Popen, timeout_s: float = 300) -> Path:
    """Ray's prom_metrics_service_discovery.json of the run's local Ray, once it lists the export the
    driver printed. The path Ray's docs give, which each Ray's writer points at its own session's file on
    every write; not `session_latest/`: Ray never replaces that link once its session directory is gone
    (`try_to_symlink` sees a dangling link as absent, and the new link then fails silently)."""
    path = Path(tempfile.gettempdir(), "ray", "prom_metrics_service_discovery.json")
    deadline = time.monotonic() + timeout_s
    while True:
        text = log.read_text(errors="replace")
        port = EXPORT.search(text)
        if port and path.exists() and f":{port.group(1)}" in path.read_text():
            return path
        listed = path.read_text() if path.exists() else "(no file)"
        assert run.poll() is None and time.monotonic() < deadline, (
            f"{path} never listed the metrics export the driver printed ({listed}):\n{text[-3000:]}"
        )
        time.sleep(1)


def dashboard_pages(log: Path, work: Path) -> dict[str, str]:
    """The Ray dashboard the driver printed, opened in a real browser as a user would (signed in with
    `ray get-auth-token`): the text of its jobs page once it shows this run's driver, and of its actors
    page once it shows each of the run's named actors; screenshots of both go to PICTURES."""
    url = DASHBOARD.search(log.read_text(errors="replace"))
    assert url, f"the driver printed no Ray dashboard:\n{log.read_text(errors='replace')[-3000:]}"
    ray_cli = Path(sys.executable).parent / "ray"
    token = subprocess.run(
        [ray_cli, "get-auth-token"], capture_output=True, text=True, timeout=60
    ).stdout.strip()
    cookies = {RAY_TOKEN_COOKIE: token} if token else {}
    # The run's named actors, and Ray Train's controller and rank (the trainer's ranks run under Ray Train).
    actors = [f"{RUN}-trainer", f"{RUN}-proxy", f"{RUN}-generator-g0", f"{RUN}-pool", "TrainController",
              "RayTrainWorker"]  # fmt: skip

    async def visit() -> dict[str, str]:
        async with browser(work) as chromium:
            jobs = await chromium.show(f"{url.group(1)}/#/jobs", ["train_grpo.py", "RUNNING"],
                                       PICTURES / "dashboard_jobs.png", cookies)  # fmt: skip
            # Ray Train's actors (its controller, the rank, its cleaner) fill the first page of 10 with ours.
            shown = await chromium.show(f"{url.group(1)}/#/actors", actors, PICTURES / "dashboard_actors.png",
                                        cookies, fields={"Page Size": "50"})  # fmt: skip
            return {"jobs": jobs, "actors": shown}

    return asyncio.run(visit())


# Not in a healthy run: a Ray counter that never counted (no request was retried) has no series.
NO_DATA_EXPECTED = ("ray_rl_proxy_retries_total",)


def panels_answering(url: str, run: subprocess.Popen, timeout_s: float = 300) -> tuple[dict, dict]:
    """Ask Prometheus each Grafana query of this run until each returned data (or the run ended): the
    panels (query -> title) that never did, and what each answered."""
    queries = {
        q: title for q, title in panel_queries(RUN).items() if not any(m in q for m in NO_DATA_EXPECTED)
    }
    answers: dict[str, list] = {}
    deadline = time.monotonic() + timeout_s
    while len(answers) < len(queries) and run.poll() is None and time.monotonic() < deadline:
        for expr in queries.keys() - answers.keys():
            if result := query(url, expr):
                answers[expr] = result
        time.sleep(2)
    return {q: t for q, t in queries.items() if q not in answers}, answers


def test_eval_pass_at_1_rises_on_the_tiny_math_task(tiny_math_model_dir, tmp_path):
    files = write_task(tmp_path / "data", train_rows=2000, seed=0)
    model_dir = tiny_math_model_dir
    overrides = [
        # A directory rather than the `tiny-math` name: both commands must name the same model, and the
        # prepared data's location follows model.path.
        f"model.path={model_dir}",
        f'task.data_files={{ train = ["{files["train"]["parquet"]}"], test = ["{files["test"]["parquet"]}"] }}',
        f"bucket.uri={tmp_path / 'bucket'}",
    ]
    prepare = subprocess.run(
        [sys.executable, "-m", "rl_cluster.data", "prepare", "--config", "jobs/configs/cpu_math.toml", *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert prepare.returncode == 0, (prepare.stdout + prepare.stderr)[-4000:]
    assert "train: 2000 of 2000 rows" in prepare.stdout and "eval: 100 of 100 rows" in prepare.stdout

    log = tmp_path / "run.log"
    with open(log, "wb") as sink:
        run = subprocess.Popen(
            [sys.executable, "jobs/train_grpo.py", "--config", "jobs/configs/cpu_math.toml", *overrides,
             f"run_name={RUN}", "cluster.address=local", "generator.replicas=1", f"trainer.max_steps={STEPS}",
             "eval.every_steps=10"],
            # Ray's metrics reach its export every second (10 s by default): the curves get a point per step.
            cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, "RAY_metrics_report_interval_ms": "1000"},
        )  # fmt: skip
        try:
            # From the start: a real Prometheus fed by Ray's service-discovery file. Every query of the Grafana
            # dashboard returns data, as Grafana would ask it, and the reward's curve over the run.
            with prometheus(discovery_file(log, run), tmp_path / "prometheus") as prom:
                started = time.time()
                # The eval scores in Ray's own metrics export (the multi-node test checks the others; its
                # demo runs no eval). The driver prints each node's export; scraped on loopback.
                exported = eval_metric(run, log)
                # Meanwhile, in a thread (the run is short, and both need it alive): the Ray dashboard in a
                # real browser, the job and the run's actors by name.
                with concurrent.futures.ThreadPoolExecutor(1) as browsing:
                    visit = browsing.submit(dashboard_pages, log, tmp_path / "chromium")
                    unanswered, answers = panels_answering(prom, run)
                    pages = visit.result()
                assert run.wait(timeout=420) == 0, log.read_text(errors="replace")[-6000:]
                curve = query_range(prom, REWARD, started, time.time(), step_s=1.0)
            assert curve, f"Prometheus holds no {REWARD} over the run"
            plot_range(curve, f"{REWARD}, from Prometheus", PICTURES / "promql_reward.png")
        finally:
            if run.poll() is None:  # a failed check: stop the run as Ctrl+C does (it cleans up after itself)
                run.send_signal(signal.SIGINT)
                try:
                    run.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    run.kill()
    out = log.read_text(errors="replace")
    assert set(exported) == {"pass@1", "mean@k"} and all(0 <= v <= 1 for v in exported.values()), exported
    assert not unanswered, f"Grafana panels whose queries Prometheus answered with no data: {unanswered}"
    by_score = {r["metric"]["score"] for r in answers['max(ray_rl_trainer_eval{run=~"e2e-math"}) by (score)']}
    assert by_score == {"pass@1", "mean@k"}, by_score
    assert {
        r["metric"]["replica"]
        for r in answers['max(ray_rl_generator_kv_cache_usage{run=~"e2e-math"}) by (replica)']
    } == {"g0"}
    assert answers['sum(rate(ray_rl_proxy_route_total{run=~"e2e-math"}[1m])) by (reason)'], answers
    (reward,) = answers[REWARD]
    assert 0.0 <= float(reward["value"][1]) <= 1.0, reward
    (points,) = curve  # one series: the run's reward, a point a second while it trained
    assert len(points["values"]) >= 5 and all(0 <= float(v) <= 1 for _, v in points["values"]), points
    assert "RUNNING" in pages["jobs"] and "ALIVE" in pages["actors"], pages
    print(f"dashboard screenshots and the reward's PromQL plot in {PICTURES}")
    run_dir = tmp_path / "bucket" / RUN
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    evals = summary["eval"]
    assert [e["step"] for e in evals["steps"]] == [0, 10, 20]
    first, last = evals["first"], evals["last"]
    print(f"eval pass@1 step 0: {first['pass@1']:.3f}, step {last['step']}: {last['pass@1']:.3f}; "
          f"mean@{last['k']} {first['mean@k']:.3f} -> {last['mean@k']:.3f}")  # fmt: skip
    assert first["version"] == 1 and first["problems"] == last["problems"] == 100  # step 0: the base model
    assert first["failed"] == last["failed"] == 0
    assert last["pass@1"] > first["pass@1"], evals["steps"]
    assert f"eval step    0  pass@1 {first['pass@1']:.3f}" in out
    # metrics.jsonl: the step records, and the evals among them.
    assert [r["step"] for r in records if r.get("kind") != "eval"] == list(range(1, STEPS + 1))
    assert [r["step"] for r in records if r.get("kind") == "eval"] == [0, 10, 20]
    assert summary["steps"] == STEPS and summary["served_check"]["mismatch"] == 0
    assert summary["served_check"]["match"] >= 1, summary["served_check"]


# Sizes a 2-core CPU can run on the tiny model; everything else (task, prompts, grader, optimiser,
# staleness, eval settings) is the recipe's own, but for a sync every 2 steps (not 4) so that two steps
# end on a sync and the eval at step 2 measures their policy. The recipes pack rows (token_budget), here
# 1,024 tokens for one recipe and 256 (the context, the least allowed) for the other. With TRL's own
# batcher 1,024 tokens held about 83 of the tiny model's samples (they share the chat template; ~12 new
# tokens each), five steps' worth, and the trainer waited for samples admission never allowed; each step
# now trains its 16 (compat item 16): in one row under 1,024 tokens, in several under 256.
# The recipes train on 2 ranks: the Qwen one does here too (its one row split into a row per rank), the
# other on one rank, so that both ways of packing a step run end to end. The one-rank run generates on
# one tensor-parallel replica over both cores (generator.tensor_parallel_size=2), the other on one core.
BUDGETS = {"qwen25_math_1p5b": 1024, "deepseek_r1_distill_qwen_1p5b": 256}
RANKS = {"qwen25_math_1p5b": 2, "deepseek_r1_distill_qwen_1p5b": 1}
TENSOR_PARALLEL = {"qwen25_math_1p5b": 1, "deepseek_r1_distill_qwen_1p5b": 2}
CPU_SIZED = [
    "model.max_model_len=256", "trainer.max_new_tokens=24",
    "trainer.completions_per_step=16", "trainer.num_cpus=0.5", "trainer.num_gpus=0", "generator.replicas=1",
    "generator.num_gpus=0", "generator.pin_cpu_cores=true", "generator.kv_cache_gb=1", "eval.max_problems=8",
    "eval.every_steps=2", "trainer.max_steps=2", "trainer.sync_every=2", "cluster.address=local",
]  # fmt: skip


@pytest.mark.parametrize("recipe", ["qwen25_math_1p5b", "deepseek_r1_distill_qwen_1p5b"])
def test_each_reference_recipe_runs_two_steps_on_the_tiny_model(recipe, tiny_math_model_dir, tmp_path):
    """The recipe's pipeline end to end, with `model.path` the tiny math model and the hub dataset
    replaced by local MATH-format files: `prepare`, then two training steps with evals at 0 and 2."""
    files = write_task(tmp_path / "data", train_rows=200, seed=1)
    config = f"jobs/configs/{recipe}.toml"
    overrides = [
        f"model.path={tiny_math_model_dir}",
        "task.dataset=parquet",
        f'task.data_files={{ train = ["{files["train"]["parquet"]}"], test = ["{files["test"]["parquet"]}"] }}',
        f"bucket.uri={tmp_path / 'bucket'}",
        *CPU_SIZED,  # the prepared data's key follows the prompt limit, so prepare sees them too
        f"trainer.token_budget={BUDGETS[recipe]}",
        f"trainer.num_workers={RANKS[recipe]}",
        f"generator.tensor_parallel_size={TENSOR_PARALLEL[recipe]}",
    ]
    prepare = subprocess.run([sys.executable, "-m", "rl_cluster.data", "prepare", "--config", config, *overrides],
                             cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert prepare.returncode == 0, (prepare.stdout + prepare.stderr)[-4000:]
    assert "train: 200 of 200 rows" in prepare.stdout, prepare.stdout
    vllm_logs = REPO / ".cache" / "logs" / f"{recipe}-tiny"  # the run's generators log there (appending)
    shutil.rmtree(vllm_logs, ignore_errors=True)
    run = subprocess.run([sys.executable, "jobs/train_grpo.py", "--config", config, *overrides,
                          f"run_name={recipe}-tiny"], cwd=REPO, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    summary = json.loads((tmp_path / "bucket" / f"{recipe}-tiny" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 2
    records = [json.loads(line) for line in (tmp_path / "bucket" / f"{recipe}-tiny" / "metrics.jsonl").open()]
    steps = [r for r in records if r.get("kind") != "eval"]
    print(
        f"{recipe}: samples per step {[r['samples'] for r in steps]}, rows {[r['microbatches'] for r in steps]}"
    )
    assert [round(r["samples"]) for r in steps] == [16, 16]  # completions_per_step, packed under the budget
    if BUDGETS[recipe] == 256:  # two groups of 8 never fit one 256-token row: the step accumulates rows
        assert all(r["microbatches"] >= 2 for r in steps), steps
    assert summary["groups"]["trained"] == 2 * 2 and summary["groups"]["failed"] == 0, summary["groups"]
    assert len(summary["trainer_ranks"]) == RANKS[recipe], summary["trainer_ranks"]
    if TENSOR_PARALLEL[recipe] > 1:  # vLLM's workers prefix their lines with their rank: one per TP rank
        log = (vllm_logs / "vllm-g0.log").read_text(errors="replace")
        assert set(re.findall(r"\(Worker_TP(\d+) pid=", log)) == {"0", "1"}, log[-3000:]
    assert [e["step"] for e in summary["eval"]["steps"]] == [0, 2]
    assert summary["eval"]["last"]["problems"] == 8 and summary["eval"]["last"]["failed"] == 0
    # In the recipe's own bf16: two steps at the recipe's learning rate move the adapter less than bf16
    # rounding lets the check see, so a check may be too close to tell; none may fail.
    assert summary["served_check"]["checks"] >= 1 and summary["served_check"]["mismatch"] == 0, summary
