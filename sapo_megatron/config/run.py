"""The whole run config, :class:`RunConfig`: one field per section, each section defined beside the feature that
reads it, and the checks that tie sections together (a layout against the world size:
:mod:`sapo_megatron.config.layout`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, model_validator

from sapo_megatron.algo.config import AlgorithmConfig
from sapo_megatron.config_section import Section
from sapo_megatron.data.config import DataConfig
from sapo_megatron.distill.config import TeacherConfig, check_distillation
from sapo_megatron.eval.config import EvalConfig, materialised_eval
from sapo_megatron.loop.config import SFTConfig, TrainerConfig
from sapo_megatron.model.config import ModelConfig, OptimizerConfig, ParallelConfig, PrecisionConfig
from sapo_megatron.model.precision import GPU_TYPES, fp8_capability_problem
from sapo_megatron.rollout.config import RolloutConfig
from sapo_megatron.runtime.config import LaunchConfig
from sapo_megatron.runtime.wandb_tracking import TrackingConfig

MAX_SEQUENCES_PER_STEP = 10_000_000  # far above any real batch; an absurd size fails here, not out of memory


class RunConfig(Section):
    """A whole run. ``name`` and ``output_dir`` decide where everything is written."""

    name: str = "run"
    output_dir: str = "runs/run"
    seed: int = 1234
    model: ModelConfig
    parallel: ParallelConfig = ParallelConfig()
    precision: PrecisionConfig = PrecisionConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    launch: LaunchConfig = LaunchConfig()
    sft: SFTConfig = SFTConfig()
    rollout: RolloutConfig = RolloutConfig()
    data: DataConfig = DataConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    trainer: TrainerConfig = TrainerConfig()
    eval: EvalConfig = Field(
        default_factory=EvalConfig, description="evaluation datasets (docs/evaluation.md)"
    )
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig, description="W&B besides TensorBoard (docs/evaluation.md)"
    )
    teachers: list[TeacherConfig] = Field(
        default_factory=list, description="teachers that score the student's samples (distillation)"
    )

    @model_validator(mode="after")
    def _check_rl(self) -> RunConfig:
        loss = self.algorithm.loss
        if loss.agg == "seq-mean-token-sum-norm" and loss.max_len is None:
            raise ValueError("algorithm.loss.agg=seq-mean-token-sum-norm needs algorithm.loss.max_len")
        if self.algorithm.routing_replay == "r3" and not self.rollout.routed_experts:
            raise ValueError(
                "algorithm.routing_replay=r3 replays the rollout engine's routes, which it only returns when "
                "asked: set rollout.routed_experts: true (SGLang servers also need --enable-return-routed-experts)"
            )
        self._check_fp8_setup()
        check_distillation(
            self.teachers,
            self.algorithm.fusion,
            self.algorithm.loss,
            self.algorithm.correction.name,
            student_logp=self.algorithm.opd_student_logp,
            temperature=self.rollout.temperature,
        )
        self._check_rollout_mode()
        if self.rollout.multi_turn is not None and not self.data.apply_chat_template:
            raise ValueError(
                "rollout.multi_turn renders tool observations with the model's chat template: set "
                "data.apply_chat_template: true (with an HF tokenizer that has one)"
            )
        mt, context = self.rollout.multi_turn, self.model.arch.max_position_embeddings
        if mt is not None and "max_context_tokens" in mt.model_fields_set and mt.max_context_tokens > context:
            raise ValueError(
                f"rollout.multi_turn.max_context_tokens={mt.max_context_tokens} is above the model's context "
                f"(model max_position_embeddings={context}): episodes would fail in the engine; lower it, or "
                "raise the model's context (with max_position_embeddings: auto it follows max_context_tokens)"
            )
        batch = self.rollout.n_samples * self.trainer.prompts_per_step
        if batch > MAX_SEQUENCES_PER_STEP:
            raise ValueError(
                f"trainer.prompts_per_step × rollout.n_samples = {batch} sequences per step is above the limit "
                f"of {MAX_SEQUENCES_PER_STEP}: lower trainer.prompts_per_step or rollout.n_samples"
            )
        if batch % self.trainer.mini_batches:
            raise ValueError(
                f"trainer.prompts_per_step × rollout.n_samples = {batch} sequences do not split into "
                f"trainer.mini_batches={self.trainer.mini_batches} equal updates"
            )
        return self

    def _check_rollout_mode(self) -> None:
        trainer = self.trainer
        mode = trainer.rollout_mode
        if mode != "sync" and self.rollout.shares_devices:
            raise ValueError(
                f"trainer.rollout_mode: {mode} overlaps generation with training, which needs servers on their own "
                f"GPUs; set rollout.colocation: none (servers on other GPUs) or trainer.rollout_mode: sync "
                f"(rollout.colocation: {self.rollout.colocation.name} shares the trainer's devices)"
            )
        buffer = trainer.async_buffer_groups
        if mode == "fully_async" and buffer is not None and buffer < trainer.prompts_per_step:
            raise ValueError(
                f"trainer.async_buffer_groups={buffer} cannot hold one step's trainer.prompts_per_step="
                f"{trainer.prompts_per_step} groups: raise it to at least {trainer.prompts_per_step} (or null)"
            )
        if mode == "fully_async" and trainer.fully_async_deterministic and trainer.async_inflight_chunks > 1:
            raise ValueError(
                f"trainer.async_inflight_chunks={trainer.async_inflight_chunks} needs the producer threads, and "
                "trainer.fully_async_deterministic: true generates one chunk at a time at fixed points: set "
                "trainer.async_inflight_chunks: 1 or trainer.fully_async_deterministic: false"
            )
        if (
            mode == "fully_async"
            and trainer.stale_groups == "correct"
            and self.algorithm.correction.name == "none"
        ):
            raise ValueError(
                "trainer.stale_groups: correct trains groups past trainer.max_staleness with the decoupled "
                "objective's proximal / behaviour weight, and algorithm.correction is none: set "
                "algorithm.correction (tis or icepop) or trainer.stale_groups: drop"
            )
        if (
            mode == "fully_async"
            and trainer.pause_mode == "retract"
            and self.algorithm.routing_replay == "r3"
            and self.rollout.engine in ("sglang", "cpu_http")
        ):
            raise ValueError(
                f"trainer.pause_mode: retract with algorithm.routing_replay: r3 on rollout.engine: "
                f"{self.rollout.engine}: after a retract SGLang (0.5.23) returns the re-prefill's new-version routes "
                "for the prefix whose log-probs are the old version's (miles #3277), and the client cannot tell a "
                "CPU server from SGLang; set trainer.pause_mode: in_place or abort (or rollout.engine: cpu)"
            )
        if self.algorithm.proximal_logp == "loglinear" and self.algorithm.routing_replay == "r2":
            raise ValueError(
                "algorithm.proximal_logp: loglinear skips the old-policy pass, which R2 needs to record the routes "
                "it replays: use algorithm.proximal_logp: recompute or algorithm.routing_replay: r3 / none"
            )
        if self.algorithm.proximal_logp == "loglinear" and getattr(
            self.algorithm.correction, "is_batch_normalize", False
        ):
            raise ValueError(
                "algorithm.proximal_logp: loglinear skips the old-policy pass, whose log-probs the batch mean of "
                "algorithm.correction.is_batch_normalize reads: set is_batch_normalize: false or "
                "algorithm.proximal_logp: recompute"
            )
        if (
            self.algorithm.proximal_logp == "loglinear"
            and self.teachers
            and self.algorithm.opd_student_logp == "trainer"
        ):
            raise ValueError(
                "algorithm.proximal_logp: loglinear skips the old-policy pass, whose log-probs the teachers' "
                "A_opd reads: set algorithm.opd_student_logp: engine or algorithm.proximal_logp: recompute"
            )

    def _check_fp8_setup(self) -> None:
        precision = self.precision
        if precision.fp8_param_gather and not self.optimizer.use_distributed_optimizer:
            raise ValueError(
                "precision.fp8_param_gather all-gathers FP8 weights from the distributed optimizer's shards: set "
                "optimizer.use_distributed_optimizer: true (Megatron's rule)"
            )
        gpu = GPU_TYPES.get(self.launch.gpu_type or "")
        if precision.dtype == "fp8" and gpu is not None:
            problem = fp8_capability_problem(
                precision.fp8_recipe, gpu.capability, f"launch.gpu_type={gpu.name}"
            )
            if problem:
                raise ValueError(problem)

    def resolved_dict(self) -> dict[str, Any]:
        """The resolved config as plain data (HF architecture inlined): what :meth:`save_resolved` writes."""
        data = self.model_dump(mode="json")
        data["model"]["hf_config"] = self.model.arch.to_hf_dict()
        data["eval"] = materialised_eval(self.eval)
        return data

    def save_resolved(self, path: str | Path) -> Path:
        """Write the resolved config (HF architecture inlined) as YAML; returns the path written."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(yaml.safe_dump(self.resolved_dict(), sort_keys=False))
        tmp.replace(path)
        return path
