"""Held-out eval during training: generated through the proxy under the newest version, graded like training.

Why through the proxy: the number should measure what the cluster serves (the published adapter, on the
replicas' vLLM, with their sampling), not what the trainer's copy of the weights would say. Each eval
problem's prompt goes in as token ids from the tokenizer's chat template, exactly as TRL's rollout worker
sends them, to the proxy's `/v1/completions` (a generation route: no control token needed): one greedy
request (temperature 0) and one with n = k samples, seeded per problem, so two evals of a run draw alike and
differ by the policy. Completions are parsed into messages the way TRL parses them and graded by the task's
first reward function with the row's columns (`answer`, ...) and `truncated` (cut off at max_new_tokens).
The aggregation is rl_cluster.core.evaluation.

The trainer waits for the eval (it is short next to a run, and simple): `EvalCallback` runs it after the
first sync (step 0), every `eval.every_steps` steps after that step's sync, and after the last step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from transformers import TrainerCallback

from rl_cluster.config import RunConfig
from rl_cluster.core.evaluation import aggregate, eval_indices
from rl_cluster.core.retry import RetriesExhausted, RetryPolicy
from rl_cluster.trainer.http import HttpClient, describe, no_answer

ROUTE = "/v1/completions"
REQUEST_TIMEOUT_S = 600.0
ATTEMPTS = 3


def _response_parser(tokenizer):
    """The tokenizer TRL's rollout worker parses completions with (it adds a response template for known
    chat templates); a copy, so the trainer's own tokenizer is left as it is."""
    from trl.chat_template_utils import add_response_schema

    if getattr(tokenizer, "response_template", None) or getattr(tokenizer, "response_schema", None):
        return tokenizer
    return add_response_schema(copy.copy(tokenizer))


class Evaluator:
    """Generates and grades the eval split under one adapter name at a time."""

    def __init__(self, config: RunConfig, proxy_url: str | Callable[[], str], tokenizer, reward_func: Callable, rows: list[dict],
                 chat_template_kwargs: dict | None = None, auth_token: str | None = None):  # fmt: skip
        """`rows`: the prepared eval split's rows (a `prompt` message list and the grader's columns);
        `auth_token`: the proxy's token (it demands the token on generation whenever it holds one)."""
        # The proxy retries a replica lost mid-request on another; these retries cover the proxy itself.
        self.http = HttpClient(
            proxy_url,
            auth_token,
            timeout_s=REQUEST_TIMEOUT_S,
            retry=RetryPolicy(attempts=ATTEMPTS, first_delay_s=1.0, max_delay_s=4.0),
            retryable=no_answer,
        )
        self.eval = config.eval
        self.max_tokens = config.trainer.max_new_tokens
        self.seed = config.trainer.seed
        self.reward_func = reward_func
        self.parser = _response_parser(tokenizer)
        picked = eval_indices(len(rows), self.eval.max_problems, self.seed)
        self.rows = [rows[i] for i in picked]
        self.prompt_ids = [
            tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                          return_dict=False, **(chat_template_kwargs or {}))
            for row in self.rows
        ]  # fmt: skip

    def _post(self, payload: dict) -> list[dict]:
        try:
            answer = self.http.post(ROUTE, payload)
        except RetriesExhausted as e:
            raise RuntimeError(
                f"eval request to {self.http.base_url}{ROUTE} failed {e.attempts} times: {describe(e.last)}"
            ) from e.last
        return sorted(answer["choices"], key=lambda c: c["index"])

    def _generate(self, adapter: str, i: int) -> tuple[dict, list[dict]]:
        common = {"model": adapter, "prompt": self.prompt_ids[i], "max_tokens": self.max_tokens,
                  "return_token_ids": True}  # fmt: skip
        greedy = self._post({**common, "n": 1, "temperature": 0.0})[0]
        sampled = self._post({**common, "n": self.eval.samples_k, "temperature": self.eval.temperature,
                              "top_p": 1.0, "seed": self.seed * 1_000_003 + i})  # fmt: skip
        return greedy, sampled

    def _grade(self, i: int, choices: list[dict]) -> list[float | None]:
        from trl.chat_template_utils import parse_response

        row, prompt_ids = self.rows[i], self.prompt_ids[i]
        ids = [c["token_ids"] for c in choices]
        columns = {key: [value] * len(choices) for key, value in row.items() if key != "prompt"}
        return self.reward_func(
            completions=[[parse_response(self.parser, c, prefix=prompt_ids)] for c in ids],
            prompts=[row["prompt"]] * len(choices),
            completion_ids=ids,
            truncated=[c.get("finish_reason") == "length" for c in choices],
            **columns,
        )

    def run(self, adapter: str, log: Callable[[str], None] = print) -> dict:
        """pass@1 and mean@k (rl_cluster.core.evaluation.aggregate) of the policy served as `adapter`."""
        greedy_P: list[float | None] = [None] * len(self.rows)
        sampled_PK: list[list[float | None] | None] = [None] * len(self.rows)
        with ThreadPoolExecutor(max_workers=self.eval.concurrency, thread_name_prefix="eval") as pool:
            futures = [pool.submit(self._generate, adapter, i) for i in range(len(self.rows))]
            for i, future in enumerate(futures):
                try:
                    greedy, sampled = future.result()
                except Exception as e:  # counted as failed; the eval of the other problems stands
                    log(f"eval problem {i} failed under {adapter}: {e}")
                    continue
                greedy_P[i] = self._grade(i, [greedy])[0]
                sampled_PK[i] = self._grade(i, sampled)
        return aggregate(greedy_P, sampled_PK, self.eval.samples_k)


class EvalCallback(TrainerCallback):
    """Calls `evaluate(step)` after the cold sync (added after TRL's callbacks, its train-begin hook runs
    after TRL's, which publishes the first version), and at the end of every `every_steps`-th step and of
    the last step (after TRL's sync of that step)."""

    def __init__(self, every_steps: int, evaluate: Callable[[int], None]):
        self.every_steps = every_steps
        self.evaluate = evaluate

    def on_train_begin(self, args, state, control, **kwargs):
        self.evaluate(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every_steps == 0 or state.global_step >= state.max_steps:
            self.evaluate(state.global_step)
