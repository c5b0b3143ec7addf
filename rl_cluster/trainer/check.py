"""Served = trained: are the logprobs vLLM serves under a version the ones the trainer computes?

After a sync, each replica samples a few completions under the new adapter name with logprobs; the
trainer recomputes the same tokens' logprobs with its model (whose adapter is exactly the one just
published: no optimizer step runs inside a sync). In fp32 the two agree to ~1e-6. A large gap means a
replica serves something other than what was trained (a stale adapter, a wrong base, a dtype or
template mismatch) and every importance ratio of the run is wrong.
"""

from __future__ import annotations

import requests
import torch

from rl_cluster.trainer.http import HttpClient, describe, no_answer


def sample_from_replica(url: str, adapter: str, prompt_ids: list[int], n: int, max_tokens: int,
                        api_key: str | None = None) -> list[dict]:  # fmt: skip
    """n sampled completions (token ids and their logprobs) from one replica, at temperature 1 so that
    vLLM's processed logprobs are the plain log-softmax. `api_key`: the run's replica key."""
    answer = HttpClient(url, api_key, timeout_s=120).post(
        "/v1/completions",
        {
            "model": adapter,
            "prompt": prompt_ids,
            "n": n,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "top_p": 1.0,
            "logprobs": 0,
            "return_token_ids": True,
        },
    )
    return [
        {"token_ids": c["token_ids"], "logprobs": c["logprobs"]["token_logprobs"]}
        for c in answer["choices"]
        if c["token_ids"]
    ]


@torch.no_grad()
def trainer_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    input_ids = torch.tensor([prompt_ids + completion_ids], device=model.device)
    logits = model(input_ids=input_ids).logits[0, len(prompt_ids) - 1 : -1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(-1, torch.tensor(completion_ids, device=model.device)[:, None])[:, 0].cpu()


def served_vs_trained_gap(model, replica_urls: list[str], adapter: str, prompt_ids: list[int], n: int,
                          max_tokens: int, api_key: str | None = None) -> dict[str, float]:  # fmt: skip
    """Mean absolute logprob difference per replica over n sampled completions; a replica that cannot be
    reached (it died after it was listed) is left out."""
    from rl_cluster.trainer.compat import plain_attention  # TRL: only in the trainer, not the driver

    was_training = model.training
    model.eval()
    gaps = {}
    try:
        with plain_attention(model):
            for url in replica_urls:
                try:
                    samples = sample_from_replica(url, adapter, prompt_ids, n, max_tokens, api_key)
                except requests.RequestException as e:
                    if not no_answer(e):
                        raise  # it answered, and refused: a replica without the adapter is no skip
                    # It was active when listed and died since, or its engine did (a 5xx): its actor
                    # restarts it, and the check goes on with the others rather than failing the sync.
                    print(
                        f"served-vs-trained check: {url} did not answer ({describe(e)}); skipped", flush=True
                    )
                    continue
                diffs = []
                for sample in samples:
                    ours = trainer_logprobs(model, prompt_ids, sample["token_ids"])
                    diffs.append((ours - torch.tensor(sample["logprobs"])).abs())
                gaps[url] = float(torch.cat(diffs).mean()) if diffs else float("nan")
    finally:
        model.train(was_training)
    return gaps


def check_sync(model, replica_urls: list[str], adapter: str, prompt_ids: list[int], check, max_tokens: int,
               api_key: str | None = None) -> float | None:  # fmt: skip
    """The sync's served-vs-trained gap (the largest over the replicas asked; None when none answered),
    with a banner in the log when it exceeds `check.tolerance` (`check`: the run's CheckConfig)."""
    gaps = served_vs_trained_gap(model, replica_urls, adapter, prompt_ids, check.samples, max_tokens, api_key)
    if not gaps:
        return None
    gap = max(gaps.values())
    if not gap <= check.tolerance:
        print(
            "\n" + "!" * 100 + f"\n!!! SERVED != TRAINED: {adapter} logprob gap {gaps} exceeds "
            f"{check.tolerance}. The replicas do not serve the adapter the trainer trained; importance "
            "ratios of this run are wrong.\n" + "!" * 100 + "\n",
            flush=True,
        )
    return gap
