"""Train a policy on alphabet_sort with GRPO on Monarch actors: the CPU demo (`make run`).

    python examples/alphabet_sort/run.py                          # the CPU demo (tiny Qwen3), from any directory
    python examples/alphabet_sort/run.py controller.steps=10      # overrides: section.key=value
    python examples/alphabet_sort/run.py --resume                 # from the last checkpoint

This is `python -m rlactors.train` (rlactors/train.py) with the demo's config and its warm
checkpoint as defaults; a run of another config or of your own env goes through that command.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from rlactors import train

EXAMPLE = Path(__file__).resolve().parent
DEFAULT_CONFIG = EXAMPLE.parents[1] / "configs" / "alphabet_sort_cpu.toml"
# The demo config names its checkpoint relative to the repository; given by absolute path here
# (before the caller's overrides, which may name another), the demo runs from any directory.
DEMO_CHECKPOINT = EXAMPLE / "warm_checkpoint_gpu"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # A resumed run takes its model.path from its own config.toml.
    if not any(arg == "--config" or arg.startswith("--config=") or arg == "--resume" for arg in argv):
        argv = [f'model.path="{DEMO_CHECKPOINT}"', *argv]
    return train.main(argv, default_config=DEFAULT_CONFIG)


if __name__ == "__main__":
    from rlactors.procs.supervision import exit_after_client_shutdown

    exit_after_client_shutdown(main())
