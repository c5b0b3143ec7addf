"""Served = trained: are the logprobs vLLM serves under a version the ones of the adapter the trainer trained?

After a sync, each replica samples a few completions under the new adapter name with logprobs; the
trainer recomputes the same tokens' logprobs with its model (whose adapter is exactly the one just
published: no optimizer step runs inside a sync), several ways: as it trains; exactly (one precision up);
in its dtype with the LoRA rounded as vLLM serves it (the rounding floor); and exactly under what a wrong
replica might serve instead (the base model; the newest older version a check told apart).
rl_cluster.core.served_check judges them. Every computation runs on the stored weights: the higher
precision is a lossless upcast, undone by putting the original tensors back.

Under FSDP2 a forward is a collective (each unit all-gathers its weights as it starts): rank 0 asks the
replicas and hands their samples to every rank, and all ranks compute the same forwards in lockstep
(`ServedCheck.run` on rank 0, `ServedCheck.join` on the others); rank 0 alone judges.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import NamedTuple

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
    """A CPU copy of the model's LoRA weights (a few MB): what an older version's check compares with.
    Whole on every rank: under FSDP2 each rank gathers the shards (a collective)."""
    from torch.distributed.tensor import DTensor

    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().to("cpu", copy=True)
        for n, p in model.named_parameters()
        if _is_lora(n)
    }


def _units(model) -> list:
    """The modules whose forward holds their weights whole: each FSDP2 unit (fully_shard gathers a unit's
    weights as its forward starts and frees them as it ends, putting its own tensors on the modules), and
    the model itself for all the others (every weight, without FSDP2)."""
    from torch.distributed.fsdp import FSDPModule

    return [model] + [m for m in model.modules() if m is not model and isinstance(m, FSDPModule)]


def _own_modules(unit, units: set[int]):
    """The unit's modules, without those of the units inside it."""
    stack = [unit]
    while stack:
        module = stack.pop()
        yield module
        stack.extend(child for child in module.children() if id(child) not in units)


@contextlib.contextmanager
def _swapped(model, replace) -> None:
    """During each forward of the model, every parameter and buffer `replace(name, tensor)` gives a new tensor
    for is that tensor; the original tensors (not converted copies) come back as the forward of the unit
    that holds them ends (`_units`), so nothing is lost to rounding, and under FSDP2 the swap sees the
    gathered weights and is undone before they are freed. The module's attributes are swapped, not the
    tensors' data: a parameter whose data changes dtype loses its gradient accumulator, and with it the hook
    by which DDP all-reduces its gradient (rank 0's check would leave its gradients out of every later step
    while the other ranks wait for them). A tensor that two modules share (tied embeddings) is swapped in
    both."""
    units = _units(model)
    unit_ids = {id(u) for u in units}
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    held: dict[int, list] = {}  # id(unit) -> (the owner's _parameters or _buffers, key, the original)

    def before(unit, _args) -> None:
        swaps, new_for = held.setdefault(id(unit), []), {}
        for module in _own_modules(unit, unit_ids):
            prefix = names[id(module)]
            for kind in ("_parameters", "_buffers"):
                tensors = getattr(module, kind)
                for leaf, tensor in list(tensors.items()):
                    if tensor is None:
                        continue
                    if id(tensor) not in new_for:
                        new_for[id(tensor)] = replace(f"{prefix}.{leaf}" if prefix else leaf, tensor.detach())
                    if (new := new_for[id(tensor)]) is None:
                        continue
                    swaps.append((tensors, leaf, tensor))
                    tensors[leaf] = (
                        torch.nn.Parameter(new, requires_grad=False) if kind == "_parameters" else new
                    )

    def after(unit, _args, _output) -> None:
        for tensors, leaf, tensor in reversed(held.pop(id(unit), [])):
            tensors[leaf] = tensor

    # Ours run inside FSDP2's: its pre-forward hook is prepended (gathers first), its post-forward appended.
    handles = [u.register_forward_pre_hook(before) for u in units]
    handles += [u.register_forward_hook(after, prepend=True) for u in units]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for unit_id in list(held):  # a forward that raised
            for tensors, leaf, tensor in reversed(held.pop(unit_id)):
                tensors[leaf] = tensor


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


class Scores(NamedTuple):
    """One replica's samples' logprobs as the trainer computes them, token by token (`judge`'s)."""

    trained: list[float]
    exact: list[float]  # one precision up
    rounded: list[float]  # the LoRA rounded to the model's dtype, as vLLM holds it
    alternatives: dict[str, list[float]]  # exactly, under what a wrong replica might serve


def scores(model, prompt_ids: list[int], samples: Sequence[dict], dtype: torch.dtype,
           older: tuple[str, dict] | None) -> Scores:  # fmt: skip
    """The trainer's side of one replica's samples, against the trained adapter, the base model and `older`
    (a version's name and its `lora_state`). The same forwards on every rank for the same samples."""
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
    return Scores(trained, exact_TOK, rounded, alternatives)


@contextlib.contextmanager
def scoring(model):
    """The model in eval mode with plain attention for a moment (compat item 7)."""
    from rl_cluster.trainer.compat import plain_attention  # TRL: only in the trainer, not the driver

    was_training = model.training
    model.eval()
    try:
        with plain_attention(model):
            yield
    finally:
        model.train(was_training)


def replica_answers(replica_urls: list[str], adapter: str, prompt_ids: list[int], *, samples: int,
                    max_tokens: int, min_tokens: int = 1,
                    api_key: str | None = None) -> list[tuple[str, list[dict]]]:  # fmt: skip
    """Each replica's samples under `adapter` (replica, samples); a replica that cannot be reached (it died
    after it was listed) is left out, as is one that sampled nothing."""
    answers = []
    for url in replica_urls:
        try:
            answer = _enough_samples(url, adapter, prompt_ids, samples, max_tokens, min_tokens, api_key)
        except requests.RequestException as e:
            if not no_answer(e):
                raise  # it answered, and refused: a replica without the adapter is no skip
            # It was active when listed and died since, or its engine did (a 5xx): its actor restarts
            # it, and the check goes on with the others rather than failing the sync.
            print(f"served-vs-trained check: {url} did not answer ({describe(e)}); skipped", flush=True)
            continue
        if answer:
            answers.append((url, answer))
    return answers


def all_scores(model, answers: list[tuple[str, list[dict]]], prompt_ids: list[int], dtype: torch.dtype,
               older: tuple[str, dict] | None) -> list[Scores]:  # fmt: skip
    """Each replica's `scores`: the forwards of a check, which under FSDP2 every rank runs, in this order."""
    with scoring(model):
        return [scores(model, prompt_ids, samples, dtype, older) for _, samples in answers]


def judged(model, answers: list[tuple[str, list[dict]]], prompt_ids: list[int], dtype: torch.dtype,
           noise_multiple: float, older: tuple[str, dict] | None) -> list[ReplicaCheck]:  # fmt: skip
    """Each replica's verdict on its answers (rl_cluster.core.served_check)."""
    computed = all_scores(model, answers, prompt_ids, dtype, older)
    return [
        judge(url, [lp for s in samples for lp in s["logprobs"]], *mine, noise_multiple)
        for (url, samples), mine in zip(answers, computed, strict=True)
    ]


def check_replicas(model, replica_urls: list[str], adapter: str, prompt_ids: list[int], *, samples: int,
                   max_tokens: int, dtype: torch.dtype, noise_multiple: float, min_tokens: int = 1,
                   older: tuple[str, dict] | None = None, api_key: str | None = None) -> list[ReplicaCheck]:  # fmt: skip
    """Each answering replica's verdict on `adapter`, in one process."""
    answers = replica_answers(
        replica_urls, adapter, prompt_ids, samples=samples, max_tokens=max_tokens, min_tokens=min_tokens,
        api_key=api_key,
    )  # fmt: skip
    return judged(model, answers, prompt_ids, dtype, noise_multiple, older)


def _from_rank_0(objects: list) -> list:
    """Rank 0's objects on every rank (a collective)."""
    import torch.distributed as dist

    dist.broadcast_object_list(objects, src=0)
    return objects


class ServedCheck:
    """The run's checks, one trainer process's share: which syncs are checked, and the older version each
    check tells the new one from (the newest one a check told apart: the check's resolution). `lockstep`:
    the model is sharded over the ranks (trainer.strategy = "fsdp2"), so each rank computes the check's
    forwards with rank 0."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.lockstep = config.trainer.strategy == "fsdp2"
        self.dtype = getattr(torch, config.model.dtype)
        self.told = False  # a check of this process could tell (match or mismatch)
        self.older: tuple[str, dict] | None = None  # the newest version told apart: name, LoRA weights

    def due(self, version: int) -> bool:
        """Every `check.every_syncs`-th sync, and each sync until one check could tell: a restarted trainer
        may never reach a multiple, and v1's adapter (B = 0) is the base model's exactly."""
        return version % self.config.check.every_syncs == 0 or not self.told

    def run(self, model, version: int, replica_urls: Callable[[], list[str]], adapter: str, prompt_ids: list[int],
            api_key: str | None = None) -> dict:  # fmt: skip
        """Rank 0, at each sync: check `adapter` on every replica (`replica_urls()`, asked only when due),
        say in the log what was found, and return the sync record's part (`served_vs_trained_gap`, `check`):
        nothing when not due or no replica answered."""
        c = self.config
        answers = []
        if self.due(version):
            answers = replica_answers(
                replica_urls(), adapter, prompt_ids, samples=c.check.samples, max_tokens=c.trainer.max_new_tokens,
                min_tokens=c.check.min_tokens, api_key=api_key,
            )  # fmt: skip
        if self.lockstep:
            _from_rank_0([answers, prompt_ids])
        if not answers:
            return {}
        checks = judged(model, answers, prompt_ids, self.dtype, c.check.noise_multiple, self.older)
        verdict = sync_verdict(checks)
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
        keep = self.older is None or verdict is Verdict.MATCH
        if self.lockstep:
            _from_rank_0([keep])
        if keep:
            self.older = (f"v{split_adapter_dir_name(adapter)[1]}", lora_state(model))
        return {
            "served_vs_trained_gap": max(r.gap for r in checks),
            "check": {"verdict": verdict.value, "replicas": [r.as_dict() for r in checks]},
        }

    def join(self, model) -> None:
        """Another rank, at each sync under `lockstep`: the forwards of rank 0's check, on rank 0's samples
        (nothing when rank 0 checks nothing), and the older version's weights when rank 0 keeps them."""
        answers, prompt_ids = _from_rank_0([None, None])
        if not answers:
            return
        all_scores(model, answers, prompt_ids, self.dtype, self.older)
        (keep,) = _from_rank_0([None])
        if keep:
            self.older = ("", lora_state(model))  # only rank 0 names it
