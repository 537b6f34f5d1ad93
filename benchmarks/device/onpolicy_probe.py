"""Where trainer and vLLM logprobs part, for one checkpoint under several engine settings (GPU).

    python benchmarks/device/onpolicy_probe.py CKPT 512:8192 256:512 512:8192:eager

Each setting (max_num_seqs:max_num_tokens[:eager]) runs the scenarios of
tests/support/vllm_scenarios.py in a fresh true on-policy vLLM engine (a process of its own;
`eager`: no CUDA graphs), then the trainer core scores every scenario's tokens, packed in rows of
2048 and 8192, by `compute_logprobs` and by the training forward (gradients on, entropy too).
Prints, per scenario, how many logprobs differ and by how much; asserts nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from support.trainer_inputs import one_rank_process_group  # noqa: E402
from support.true_on_policy import trainer_and_generator_logprobs  # noqa: E402
from support.vllm_checks import scenario_episode  # noqa: E402

from rlactors.config import BatcherConfig, ModelConfig, TrainerConfig  # noqa: E402
from rlactors.on_policy.sides import sides  # noqa: E402
from rlactors.rollout.batcher import Batcher  # noqa: E402
from rlactors.rollout.types import Episode  # noqa: E402
from rlactors.trainer.core import PolicyTrainerCore  # noqa: E402

SCENARIOS = ROOT / "tests" / "support" / "vllm_scenarios.py"
# Runs the scenario script with CUDA graphs off (enforce_eager added to the engine args).
EAGER = ("import runpy, sys; from rlactors.on_policy import vllm_model as m; "
         "m.TRUE_ON_POLICY_ENGINE_ARGS = {**m.TRUE_ON_POLICY_ENGINE_ARGS, 'enforce_eager': True, "
         "'compilation_config': {'mode': 0}}; "
         "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def training_forward_logprobs(core: PolicyTrainerCore, episodes: list[Episode], row_tokens: int):
    packed = Batcher(BatcherConfig(row_tokens=row_tokens, rows_per_microbatch=2)).pack(episodes)
    trainer, generator = [], []
    for mb in packed.per_rank[0]:
        mb = mb.to(core.device)
        with torch.enable_grad():
            logprobs, _ = core._token_logprobs(mb, with_entropy=True)
        trainer.append(logprobs.detach().reshape(mb.input_ids.shape)[mb.loss_mask].cpu())
        generator.append(mb.generator_logprobs[mb.loss_mask].cpu())
    return torch.cat(trainer), torch.cat(generator)


def report(name: str, trainer: torch.Tensor, generator: torch.Tensor) -> None:
    differ = trainer != generator
    gap = (trainer - generator).abs()
    print(f"  {name}: {int(differ.sum())} of {differ.numel()} differ, max {gap.max():.4g}", flush=True)


def main(ckpt: str, settings: list[str]) -> None:
    for setting in settings:
        seqs, tokens, *eager = setting.split(":")
        out = Path(tempfile.mkdtemp()) / "scenarios.json"
        script = [sys.executable, "-c", EAGER, str(SCENARIOS)] if eager else [sys.executable, str(SCENARIOS)]
        done = subprocess.run([*script, ckpt, ckpt, str(out), seqs, tokens], capture_output=True, text=True)
        print(f"setting {setting}: scenarios rc={done.returncode}", flush=True)
        if done.returncode != 0:
            print(done.stderr[-3000:])
            continue
        scenarios = json.loads(out.read_text())
        with one_rank_process_group("cuda") as device:
            core = PolicyTrainerCore(ModelConfig(path=ckpt, dtype="bfloat16", true_on_policy=True),
                                     TrainerConfig(ranks=1), device, sides(True, "vllm", device).trainer)
            for name, completions in scenarios.items():
                episodes = [scenario_episode(c) for c in completions.values()]
                for row_tokens in (2048, 8192):
                    report(f"{name} rows {row_tokens}", *trainer_and_generator_logprobs(core, episodes, row_tokens))
                report(f"{name} training forward", *training_forward_logprobs(core, episodes, 8192))
            del core


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
