"""Held-out eval: the aggregation, the records, the config rules, and the runner against a stub
/v1/completions (what it sends, how it grades) — no vLLM."""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from rl_cluster.config import load_config
from rl_cluster.core.evaluation import (
    aggregate,
    eval_indices,
    eval_line,
    eval_record,
    eval_summary,
    split_records,
    with_evals,
)
from rl_cluster.core.rewards import math_reward
from rl_cluster.core.summary import NEVER_DEDUPLICATED, summarize, summary_table

REPO = Path(__file__).resolve().parents[2]
DATASET = [
    "task.prompts=dataset",
    "task.dataset=parquet",
    'task.data_files={ train = ["t.parquet"], test = ["e.parquet"] }',
    "task.eval_split=test",
]


def test_aggregate_scores_greedy_and_sampled_and_leaves_failures_out():
    scores = aggregate([1.0, 0.0, 1.0, None], [[1, 1, 0, 0], [0, 0, 0, 1], [1, 1, 1, 1], None], k=4)
    assert scores == {"pass@1": 2 / 3, "mean@k": (0.5 + 0.25 + 1.0) / 3, "k": 4, "problems": 3, "failed": 1}


def test_aggregate_counts_ungradable_as_wrong_and_checks_shapes():
    assert aggregate([None], [[1.0]], k=1)["pass@1"] is None  # every request failed: no score, not 0
    assert aggregate([math.nan], [[None, 1.0]], k=2) == {
        "pass@1": 0.0, "mean@k": 0.5, "k": 2, "problems": 1, "failed": 0,
    }  # fmt: skip
    with pytest.raises(ValueError, match="not k=4"):
        aggregate([1.0], [[1.0, 1.0]], k=4)
    with pytest.raises(ValueError, match="2 greedy scores for 1"):
        aggregate([1.0, 1.0], [[1.0]], k=1)


def test_eval_indices_are_a_fixed_sample():
    picked = eval_indices(1000, 50, seed=3)
    assert picked == sorted(set(picked)) and len(picked) == 50 and max(picked) < 1000
    assert picked == eval_indices(1000, 50, seed=3) != eval_indices(1000, 50, seed=4)
    assert eval_indices(7, None, 0) == eval_indices(7, 100, 0) == list(range(7))


def test_metrics_records_keep_steps_and_evals_apart():
    steps = [{"step": s, "reward": 0.1 * s} for s in (1, 2, 3, 4)]
    scores = aggregate([1.0, 0.0], [[1.0, 0.0], [0.0, 0.0]], k=2)
    evals = [eval_record(s, f"r-v{s + 1}", s + 1, scores, 1.234) for s in (4, 0, 2)]
    merged = with_evals(steps, evals)
    order = [(r["step"], r.get("kind")) for r in merged]
    assert order == [(0, "eval"), (1, None), (2, None), (2, "eval"), (3, None), (4, None), (4, "eval")]
    assert split_records(json.loads(json.dumps(merged))) == (steps, sorted(evals, key=lambda r: r["step"]))
    assert evals[0]["eval_s"] == 1.23 and evals[0]["adapter"] == "r-v5"


def test_eval_line_and_summary():
    first = eval_record(0, "r-v1", 1, aggregate([0.0, 1.0], [[0.0], [1.0]], k=1), 3.0)
    last = eval_record(20, "r-v21", 21, aggregate([1.0, None], [[1.0], None], k=1), 2.5)
    line = eval_line(last)
    assert line.startswith("eval step   20  pass@1 1.000  mean@1 1.000") and "1 failed" in line
    import re

    assert re.search(NEVER_DEDUPLICATED, line)  # Ray must not fold eval lines together
    summary = eval_summary([last, first])
    assert summary["first"] is first and summary["last"] is last
    assert summary["steps"] == [
        {"step": 0, "pass@1": 0.5, "mean@k": 0.5},
        {"step": 20, "pass@1": 1.0, "mean@k": 1.0},
    ]
    assert eval_summary([]) is None


def test_run_summary_carries_the_evals():
    result = {"history": [{"step": 1, "reward": 0.5, "staleness": 0.0, "dropped_stale": 0.0}], "syncs": []}
    assert summarize(result, {}, 1.0)["eval"] is None
    result["evals"] = [eval_record(s, "r", s + 1, aggregate([s / 10], [[0.5]], k=1), 1.0) for s in (0, 10)]
    summary = summarize(result, {}, 1.0)
    assert (summary["eval"]["first"]["pass@1"], summary["eval"]["last"]["pass@1"]) == (0.0, 1.0)
    table = summary_table(summary)
    assert "eval, first (step 0)" in table and "pass@1 1.000  mean@1 0.500" in table


def test_curves_get_an_eval_panel():
    from io import BytesIO

    from PIL import Image

    from rl_cluster.plots import curves_png

    history = [{"step": s, "reward": 0.1, "staleness": 1.0, "policy_version": s} for s in range(1, 11)]
    evals = [eval_record(s, "r", s + 1, aggregate([s / 10], [[0.5]], k=1), 1.0) for s in (0, 5, 10)]
    plain = Image.open(BytesIO(curves_png(history, "t")))
    with_eval = Image.open(BytesIO(curves_png(history, "t", evals=evals)))
    assert with_eval.height > plain.height  # the third panel
    evals[1]["pass@1"] = None  # an eval whose every request failed still plots
    curves_png(history, "t", evals=evals)


def test_eval_config_rules():
    assert load_config(None, []).eval.every_steps == 0  # off unless asked for
    with pytest.raises(ValueError, match="needs a held-out split"):
        load_config(None, ["eval.every_steps=10"])
    with pytest.raises(ValueError, match="not a multiple of trainer.sync_every=4"):
        load_config(None, [*DATASET, "eval.every_steps=10", "trainer.sync_every=4"])
    with pytest.raises(ValueError, match="exceeds proxy.max_n"):
        load_config(None, [*DATASET, "eval.every_steps=8", "eval.samples_k=9", "proxy.max_n=8"])
    with pytest.raises(ValueError, match="Extra inputs"):
        load_config(None, ["eval.every=1"])
    assert load_config(None, [*DATASET, "eval.every_steps=8", "trainer.sync_every=4"]).eval.every_steps == 8
    math_run = load_config(REPO / "jobs/configs/cpu_math.toml")
    assert (math_run.eval.every_steps, math_run.model.path, math_run.task.eval_split) == (
        10,
        "tiny-math",
        "test",
    )


def test_eval_callback_runs_after_the_cold_sync_every_n_steps_and_at_the_end():
    from rl_cluster.trainer.evaluation import EvalCallback

    steps = []
    callback = EvalCallback(10, steps.append)
    state = SimpleNamespace(global_step=0, max_steps=25)
    callback.on_train_begin(None, state, None)
    for step in range(1, 26):
        state.global_step = step
        callback.on_step_end(None, state, None)
    assert steps == [0, 10, 20, 25]


class _StubCompletions(BaseHTTPRequestHandler):
    """/v1/completions that answers with fixed token ids: greedy right, samples right one time in four."""

    requests: list[dict] = []
    right: list[int] = []
    wrong: list[int] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append({"path": self.path, "auth": self.headers.get("Authorization"), **body})
        if body["prompt"][-1] == 99999:  # not a token id of ours: a replica error
            self.send_response(500)
            self.end_headers()
            return
        outs = [self.right] if body["temperature"] == 0 else [self.right] + [self.wrong] * (body["n"] - 1)
        choices = [{"index": i, "token_ids": ids, "finish_reason": "stop" if ids[-1] == 2 else "length"}
                   for i, ids in enumerate(outs)]  # fmt: skip
        payload = json.dumps({"choices": list(reversed(choices))}).encode()  # order by `index`, not position
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


def test_evaluator_generates_through_the_completions_route_and_grades_like_training(monkeypatch):
    from rl_cluster.tiny import _make_tokenizer
    from rl_cluster.trainer import evaluation

    monkeypatch.setattr(evaluation, "ATTEMPTS", 1)
    tokenizer = _make_tokenizer()
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    _StubCompletions.requests = []
    _StubCompletions.right = encode("$3+4=\\boxed{7}$") + [tokenizer.eos_token_id]
    _StubCompletions.wrong = encode("$3+4=\\boxed{7")  # cut off at max_new_tokens: scores 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StubCompletions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        config = load_config(None, [*DATASET, "eval.every_steps=4", "eval.samples_k=4", "trainer.seed=7",
                                    "trainer.max_new_tokens=24", "eval.temperature=0.7"])  # fmt: skip
        rows = [{"prompt": [{"role": "user", "content": f"What is ${a}+4$?"}], "answer": "7", "level": "1"}
                for a in (3, 3, 3)]  # fmt: skip
        evaluator = evaluation.Evaluator(config, f"http://127.0.0.1:{server.server_port}/", tokenizer,
                                         math_reward, rows)  # fmt: skip
        evaluator.prompt_ids[2] = [*evaluator.prompt_ids[2], 99999]  # the third problem's requests fail
        logged = []
        scores = evaluator.run("run-v3", log=logged.append)
    finally:
        server.shutdown()
    assert scores == {"pass@1": 1.0, "mean@k": 0.25, "k": 4, "problems": 2, "failed": 1}
    assert len(logged) == 1 and "eval problem 2 failed under run-v3" in logged[0] and "HTTP 500" in logged[0]
    prompt_ids = tokenizer.apply_chat_template(
        rows[0]["prompt"], add_generation_prompt=True, return_dict=False
    )
    sent = [r for r in _StubCompletions.requests if r["prompt"] == prompt_ids]
    assert {r["path"] for r in sent} == {"/v1/completions"} and {r["auth"] for r in sent} == {None}
    assert all(r["model"] == "run-v3" and r["max_tokens"] == 24 and r["return_token_ids"] for r in sent)
    greedy = [r for r in sent if r["temperature"] == 0]
    sampled = [r for r in sent if r["temperature"] == 0.7]
    assert len(greedy) == len(sampled) == 2 and all(r["n"] == 1 for r in greedy)
    assert all(r["n"] == 4 and r["top_p"] == 1.0 for r in sampled)
    # Each problem's samples are seeded by the problem, the same at every eval of the run.
    assert sorted(r["seed"] for r in sampled) == [7 * 1_000_003, 7 * 1_000_003 + 1]
