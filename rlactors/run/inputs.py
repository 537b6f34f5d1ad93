"""What a run trains on, loaded and checked before any proc starts: the tokenizer, the env with
its train split as a SampleStream, the Rollouter, the evaluator and the Batcher."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlactors.config import Config, check_model_keys
from rlactors.rollout.batcher import Batcher
from rlactors.rollout.env import SampleStream, TokenEnv, load_env
from rlactors.rollout.rollouter import GenerateFn, Rollouter, prompts_too_long_line
from rlactors.run.evaluation import Evaluator, training_evaluator
from rlactors.run.memory_plan import MemoryPlan, gpu_gib, plan
from rlactors.run.metrics import check_wandb
from rlactors.run.run_dir import TrainingError


@dataclass
class RunInputs:
    tokenizer: Any
    env: TokenEnv
    samples: SampleStream
    rollouter: Rollouter
    evaluator: Evaluator | None  # with controller.eval_every
    batcher: Batcher
    memory: MemoryPlan | None  # with controller.device "cuda"


async def load_inputs(c: Config, generate: GenerateFn) -> RunInputs:
    """The inputs of a run of `c` whose completions come from `generate`, and on CUDA its memory
    plan; a plan that does not fit is a ConfigError, an empty train split a TrainingError, and
    prompts too long to sample from are counted in one printed line."""
    from rlactors.models import load_checked_tokenizer
    from rlactors.models.checkpoint import load_args
    from rlactors.trainer.teacher import check_teacher_tokenizer

    tokenizer = load_checked_tokenizer(c.model.path)
    args = load_args(c.model.path)
    check_model_keys(c.model, c.trainer, args)
    if c.teacher.path:
        check_teacher_tokenizer(c.teacher.path, c.model.path)
    memory = plan(c, args, gpu_gib(c)) if c.controller.device == "cuda" else None
    if memory is not None:  # a run that cannot fit stops here, before any proc starts
        memory.check()
    env = load_env(c.env, tokenizer)
    dataset = env.dataset("train")
    if len(dataset) == 0:
        raise TrainingError(f"env {c.env.name}: the train split is empty")
    rollouter = Rollouter(env, generate, c.rollout, seed=c.controller.seed)
    too_long = await rollouter.prompts_too_long(dataset)
    if too_long:
        print(prompts_too_long_line(too_long, len(dataset), c.rollout.max_total_tokens), flush=True)
    evaluator = training_evaluator(env, c, generate)
    if c.metrics.wandb_project:
        check_wandb()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return RunInputs(tokenizer, env, SampleStream(dataset, seed=c.controller.seed), rollouter, evaluator,
                     Batcher(c.batcher, dp_size=c.trainer.ranks, pad_token_id=pad_id), memory)
