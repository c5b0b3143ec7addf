"""Served = trained: are the logprobs vLLM serves under a version the ones of the adapter the trainer trained?

After a sync, each replica samples a few completions under the new adapter name with logprobs; the
trainer recomputes the same tokens' logprobs with its model (whose adapter is exactly the one just
published: no optimizer step runs inside a sync), several ways: as it trains; exactly (one precision up);
in its dtype with the LoRA rounded as vLLM serves it (the rounding floor); and exactly under what a wrong
replica might serve instead (the base model; the newest older version a check told apart).
rl_cluster.core.served_check judges them. Every computation runs on the stored weights: the higher
precision is a lossless upcast, undone by putting the original tensors back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import requests
import torch

from rl_cluster.config import RunConfig
from rl_cluster.core.manifest import split_adapter_dir_name
from rl_cluster.core.served_check import (
    ReplicaCheck,
    Verdict,
    judge,
    mismatch_banner,
    sync_verdict,
    undecided_line,
)
from rl_cluster.trainer.http import HttpClient, describe, no_answer

# Exact = one precision up from the model's dtype.
_EXACT = {torch.bfloat16: torch.float32, torch.float16: torch.float32, torch.float32: torch.float64}


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


MAX_ROUNDS = 8


def _enough_samples(url: str, adapter: str, prompt_ids: list[int], n: int, max_tokens: int, min_tokens: int,
                    api_key: str | None) -> list[dict]:  # fmt: skip
    """Rounds of n completions from one replica until they hold `min_tokens` tokens (or MAX_ROUNDS)."""
    found: list[dict] = []
    for _ in range(MAX_ROUNDS):
        found += sample_from_replica(url, adapter, prompt_ids, n, max_tokens, api_key)
        if sum(len(s["token_ids"]) for s in found) >= min_tokens:
            break
    return found


def _is_lora(name: str) -> bool:
    return ".lora_" in name


def lora_state(model) -> dict[str, torch.Tensor]:
    """A CPU copy of the model's LoRA weights (a few MB): what an older version's check compares with."""
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if _is_lora(n)}


@contextlib.contextmanager
def _swapped(model, replace) -> None:
    """Every parameter and buffer `replace(name, tensor)` gives a new tensor for is that tensor for a moment;
    the original tensors (not converted copies) come back, so nothing is lost to rounding. The module's
    attributes are swapped, not the tensors' data: a parameter whose data changes dtype loses its gradient
    accumulator, and with it the hook by which DDP all-reduces its gradient (rank 0's check would leave
    its gradients out of every later step while the other ranks wait for them). A tensor that two modules
    share (tied embeddings) is swapped in both."""
    held = []  # (the owner's _parameters or _buffers, key, the original)
    new_for: dict[int, torch.Tensor | None] = {}
    for kind, named in (("_parameters", model.named_parameters), ("_buffers", model.named_buffers)):
        for name, tensor in list(named(remove_duplicate=False)):
            if id(tensor) not in new_for:
                new_for[id(tensor)] = replace(name, tensor.detach())
            if (new := new_for[id(tensor)]) is None:
                continue
            owner_name, _, leaf = name.rpartition(".")
            owner = getattr(model.get_submodule(owner_name), kind)
            held.append((owner, leaf, tensor))
            owner[leaf] = torch.nn.Parameter(new, requires_grad=False) if kind == "_parameters" else new
    try:
        yield
    finally:
        for owner, leaf, tensor in reversed(held):
            owner[leaf] = tensor


def computed_in(model, dtype: torch.dtype):
    """The model's floating weights and buffers in `dtype` for a moment (an upcast is lossless)."""
    return _swapped(model, lambda _, t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else None)


def lora_rounded(model, dtype: torch.dtype):
    """The LoRA weights rounded to `dtype`, as vLLM holds them (PEFT keeps them in fp32 beside a bf16
    base, and casts the activations to them: with them in bf16 the LoRA branch computes in bf16 too)."""
    return _swapped(model, lambda n, t: t.to(dtype) if _is_lora(n) and t.dtype != dtype else None)


def lora_weights(model, weights: dict[str, torch.Tensor]):
    """Another version's LoRA weights (`lora_state`) in place of the trained ones, for a moment."""
    return _swapped(
        model, lambda n, t: weights[n].to(t.device, t.dtype) if _is_lora(n) and n in weights else None
    )


@torch.no_grad()
def trainer_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    input_ids = torch.tensor([prompt_ids + completion_ids], device=model.device)
    logits = model(input_ids=input_ids).logits[0, len(prompt_ids) - 1 : -1]
    logprobs = torch.log_softmax(logits.to(torch.float64), dim=-1)
    return logprobs.gather(-1, torch.tensor(completion_ids, device=model.device)[:, None])[:, 0].tolist()


def _logprobs_TOK(model, prompt_ids: list[int], samples: Sequence[dict]) -> list[float]:
    return [lp for s in samples for lp in trainer_logprobs(model, prompt_ids, s["token_ids"])]


def judge_samples(model, replica: str, prompt_ids: list[int], samples: Sequence[dict], dtype: torch.dtype,
                  noise_multiple: float, older: tuple[str, dict] | None = None) -> ReplicaCheck:  # fmt: skip
    """One replica's samples judged against the trained adapter, the base model and `older` (a version's
    name and its `lora_state`)."""
    exact = _EXACT[dtype]
    trained = _logprobs_TOK(model, prompt_ids, samples)
    rounded = trained  # a LoRA already held in the model's dtype (fp32 runs) is as vLLM holds it
    if any(_is_lora(n) and p.dtype != dtype for n, p in model.named_parameters()):
        with lora_rounded(model, dtype):
            rounded = _logprobs_TOK(model, prompt_ids, samples)
    with computed_in(model, exact):
        exact_TOK = _logprobs_TOK(model, prompt_ids, samples)
        with model.disable_adapter():
            alternatives = {"base": _logprobs_TOK(model, prompt_ids, samples)}
        if older is not None:
            name, weights = older
            with lora_weights(model, weights):
                alternatives[name] = _logprobs_TOK(model, prompt_ids, samples)
    served = [lp for s in samples for lp in s["logprobs"]]
    return judge(replica, served, trained, exact_TOK, rounded, alternatives, noise_multiple)


def check_replicas(model, replica_urls: list[str], adapter: str, prompt_ids: list[int], *, samples: int,
                   max_tokens: int, dtype: torch.dtype, noise_multiple: float, min_tokens: int = 1,
                   older: tuple[str, dict] | None = None, api_key: str | None = None) -> list[ReplicaCheck]:  # fmt: skip
    """Each replica's verdict on `adapter` (rl_cluster.core.served_check); a replica that cannot be reached
    (it died after it was listed) is left out."""
    from rl_cluster.trainer.compat import plain_attention  # TRL: only in the trainer, not the driver

    was_training = model.training
    model.eval()
    checks = []
    try:
        with plain_attention(model):
            for url in replica_urls:
                try:
                    answer = _enough_samples(
                        url, adapter, prompt_ids, samples, max_tokens, min_tokens, api_key
                    )
                except requests.RequestException as e:
                    if not no_answer(e):
                        raise  # it answered, and refused: a replica without the adapter is no skip
                    # It was active when listed and died since, or its engine did (a 5xx): its actor
                    # restarts it, and the check goes on with the others rather than failing the sync.
                    print(
                        f"served-vs-trained check: {url} did not answer ({describe(e)}); skipped", flush=True
                    )
                    continue
                if answer:
                    checks.append(judge_samples(model, url, prompt_ids, answer, dtype, noise_multiple, older))
    finally:
        model.train(was_training)
    return checks


class ServedCheck:
    """The run's checks, one trainer process's share: which syncs are checked, and the older version each
    check tells the new one from (the newest one a check told apart: the check's resolution)."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.told = False  # a check of this process could tell (match or mismatch)
        self.older: tuple[str, dict] | None = None  # the newest version told apart: name, LoRA weights

    def due(self, version: int) -> bool:
        """Every `check.every_syncs`-th sync, and each sync until one check could tell: a restarted trainer
        may never reach a multiple, and v1's adapter (B = 0) is the base model's exactly."""
        return version % self.config.check.every_syncs == 0 or not self.told

    def run(self, model, replica_urls: list[str], adapter: str, prompt_ids: list[int],
            api_key: str | None = None) -> dict:  # fmt: skip
        """Check `adapter` on every replica, say in the log what was found, and return the sync record's part
        (`served_vs_trained_gap`, `check`): nothing when no replica answered."""
        c = self.config
        checks = check_replicas(
            model, replica_urls, adapter, prompt_ids, samples=c.check.samples, max_tokens=c.trainer.max_new_tokens,
            dtype=getattr(torch, c.model.dtype), noise_multiple=c.check.noise_multiple,
            min_tokens=c.check.min_tokens, older=self.older, api_key=api_key,
        )  # fmt: skip
        verdict = sync_verdict(checks)
        if verdict is None:
            return {}
        for replica in checks:
            if replica.verdict is Verdict.MISMATCH:
                bar = "!" * 100
                print(f"\n{bar}\n!!! {mismatch_banner(adapter, replica, c.model.dtype)}\n{bar}\n", flush=True)
            elif replica.verdict is Verdict.UNDECIDED:
                print(undecided_line(adapter, replica), flush=True)
        self.told = self.told or verdict is not Verdict.UNDECIDED
        # The older version stays the one this check last told apart until a new version is told apart
        # from it: compared with the version just before, every check of small steps in bf16 would be too
        # close to tell.
        if self.older is None or verdict is Verdict.MATCH:
            self.older = (f"v{split_adapter_dir_name(adapter)[1]}", lora_state(model))
        return {
            "served_vs_trained_gap": max(r.gap for r in checks),
            "check": {"verdict": verdict.value, "replicas": [r.as_dict() for r in checks]},
        }
