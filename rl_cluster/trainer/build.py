"""How a run's TRL trainer is made: AsyncGRPOConfig from the run config, the AsyncGRPOTrainer with the
run's LoRA, rewards, callbacks and admission window, and what goes around it (the experience writer, the
held-out evaluator). TRL, PEFT and the data modules are imported inside: the trainer actor's process
loads them, the driver never does."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from rl_cluster.bucket import Bucket
from rl_cluster.config import RunConfig
from rl_cluster.core.admission import AdmissionWindow
from rl_cluster.core.fence import WriteFence
from rl_cluster.trainer.proxy_client import ProxyClient
from rl_cluster.trainer.task import import_function


def admission_window(config: RunConfig) -> AdmissionWindow:
    t = config.trainer
    return AdmissionWindow.for_trainer(
        t.completions_per_step, t.num_generations, t.sync_every, t.max_staleness, lockstep=t.mode == "sync"
    )


def grpo_args(config: RunConfig, proxy_url: str, admission: AdmissionWindow):
    """TRL's AsyncGRPOConfig for the run: generation through the proxy, checkpoints every
    trainer.checkpoint_every steps, no reporting of TRL's own (the trainer actor reports)."""
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from rl_cluster.trainer.compat import pipeline_limits, training_precision_kwargs

    c, t = config, config.trainer
    return AsyncGRPOConfig(
        output_dir=tempfile.mkdtemp(prefix=f"rl_cluster-{c.run_name}-"),
        vllm_server_base_url=proxy_url,
        learning_rate=t.learning_rate,
        lr_scheduler_type=t.lr_scheduler,
        adam_beta2=t.adam_beta2,
        num_generations=t.num_generations,
        per_device_train_batch_size=t.completions_per_step // t.num_workers,  # a step's share per rank
        max_completion_length=t.max_new_tokens,
        temperature=t.temperature,
        max_staleness=t.max_staleness,
        **pipeline_limits(admission, t.num_generations),
        weight_sync_steps=t.sync_every,
        max_steps=t.max_steps,
        seed=t.seed,
        gradient_checkpointing=t.gradient_checkpointing,
        token_budget=t.token_budget,
        dtype=c.model.dtype,
        logging_steps=1,
        save_strategy="steps" if t.checkpoint_every else "no",
        save_steps=t.checkpoint_every or 500,
        report_to="none",
        # Every LoRA weight takes part in each forward: DDP's search for unused ones is a graph walk per step.
        ddp_find_unused_parameters=False,
        disable_tqdm=True,
        **training_precision_kwargs(),
        **sharding_kwargs(t.strategy),
    )


def sharding_kwargs(strategy: str) -> dict:
    """FSDP2 over the ranks for `fsdp2` (each decoder layer a unit, by the model's `_no_split_modules`),
    full-state checkpoints (one flat directory, as the bucket keeps them); nothing for DDP."""
    if strategy != "fsdp2":
        return {}
    return {
        "fsdp": "full_shard",
        "fsdp_config": {"version": 2, "state_dict_type": "FULL_STATE_DICT", "reshard_after_forward": True},
    }


def build_trainer(
    config: RunConfig,
    model_dir: Path,
    dataset,
    *,
    bucket: Bucket,
    proxy: ProxyClient,
    base_fingerprint: str,
    on_step: Callable[[int, dict], None],
    on_checkpoint: Callable[[int, str], None],
    on_sync: Callable[[int, str, dict], None],
    on_sample: Callable,
    stopping: threading.Event,
    fence: WriteFence,
):
    """TRL's AsyncGRPOTrainer (our BucketSyncTrainer) with the run's LoRA, rewards, callbacks and admission
    window; adapter versions continue after the highest the bucket ever held. Training ends at the end of
    a step once `stopping` is set; each write into the bucket passes `fence` first."""
    from peft import LoraConfig

    from rl_cluster.trainer.callbacks import CheckpointPublisher, ShareReport, StepReporter, StopWhenAsked
    from rl_cluster.trainer.compat import quiet_default_printer
    from rl_cluster.trainer.correction import OffPolicyCorrection
    from rl_cluster.trainer.grpo import BucketSyncTrainer

    c = config
    admission = admission_window(c)
    lora = LoraConfig(
        r=c.lora.rank,
        lora_alpha=c.lora.alpha,
        target_modules=c.lora.target_modules,
        lora_dropout=c.lora.dropout,
        task_type="CAUSAL_LM",
    )
    trainer = BucketSyncTrainer(
        model=str(model_dir),
        reward_funcs=[import_function(r) for r in c.task.rewards],
        args=grpo_args(c, proxy.url, admission),
        train_dataset=dataset,
        peft_config=lora,
        callbacks=[StepReporter(on_step), CheckpointPublisher(on_checkpoint), ShareReport(c.trainer)],
        run_name=c.run_name,
        bucket=bucket,
        proxy=proxy,
        base_model=c.model.path,
        base_fingerprint=base_fingerprint,
        keep_every=c.bucket.keep_every,
        on_sync=on_sync,
        on_sample=on_sample,
        admission=admission,
        fence=fence,
        correction=OffPolicyCorrection(
            c.trainer.correction, c.trainer.correction_cap, c.trainer.correction_band
        ),
        first_version=max(bucket.list_versions(c.run_name, c.run_name), default=0) + 1,
    )
    quiet_default_printer(trainer)
    trainer.add_callback(StopWhenAsked(stopping, trainer.accelerator))
    return trainer


def experience_writer(config: RunConfig, bucket: Bucket):
    """The run's experience store writer (rl_cluster.experience), or None when experience.enabled is off."""
    if not config.experience.enabled:
        return None
    from rl_cluster.experience import ExperienceWriter

    return ExperienceWriter(
        bucket,
        config.run_name,
        config.run_name,
        num_generations=config.trainer.num_generations,
        shard_groups=config.experience.shard_groups,
    )


def evaluator(config: RunConfig, trainer, proxy: ProxyClient):
    """The held-out evaluator through the proxy, with the trainer's tokenizer and chat template."""
    from rl_cluster.data import load_prepared
    from rl_cluster.trainer.evaluation import Evaluator

    return Evaluator(
        config,
        proxy.address,  # follows the proxy where it moves, as the control calls do
        trainer.processing_class,
        import_function(config.task.rewards[0]),
        load_prepared(config, "eval").to_list(),
        chat_template_kwargs=trainer.args.chat_template_kwargs,
        auth_token=proxy.auth_token,
    )
