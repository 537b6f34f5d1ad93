"""The short whole run that tests/test_e2e.py and tests/test_slurm.py share: alphabet_sort from the
demo's warm checkpoint (its rewards vary), 2 trainer ranks (FSDP2, gloo) and 2 native replicas, 3
short steps."""

from pathlib import Path

WARM_CHECKPOINT = Path(__file__).resolve().parents[2] / "examples" / "alphabet_sort" / "warm_checkpoint"


def short_run_overrides(ckpt: Path, run_dir: Path, *extra: str) -> list[str]:
    """The config overrides of the short run of `ckpt` in `run_dir`; `extra` after them."""
    return [f'model.path="{ckpt}"', f'controller.run_dir="{run_dir}"', "controller.steps=3",
            "trainer.ranks=2", "trainer.lr=1e-3", "generator.replicas=2", "generator.max_model_len=512",
            "generator.kv_cache_tokens=8192", "rollout.prompts_per_step=2", "rollout.group_size=4",
            "rollout.max_turns=2", "rollout.max_tokens_per_turn=24", "rollout.max_total_tokens=384",
            "rollout.keep_zero_variance_groups=true", "batcher.row_tokens=512",
            "env.args={ max_turns = 2, max_names_per_turn = 2 }", *extra]
