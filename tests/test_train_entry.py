"""The library's command line, `python -m rlactors.train`, and the examples as the installed
package `rlactors_examples`: the demo script is a thin call of the command and runs from any
directory."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import rlactors_examples
from rlactors_examples.alphabet_sort import run

REPO = Path(__file__).resolve().parents[1]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_python_m_rlactors_train_runs_and_names_what_is_missing(tmp_path):
    usage = _run(["-m", "rlactors.train", "--help"], tmp_path)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: python -m rlactors.train [-h] [--config CONFIG]")
    missing = _run(["-m", "rlactors.train"], tmp_path)
    assert missing.returncode == 2
    assert missing.stderr.splitlines() == [
        "error: model.path: missing; it has no default (set it in the config file, or as model.path=...)"]


def test_the_demo_script_runs_from_another_directory(tmp_path):
    """From elsewhere, the demo finds its config and checkpoint and imports its env from the
    installed package; an impossible env argument then stops it before any proc starts."""
    done = _run([str(REPO / "examples" / "alphabet_sort" / "run.py"), "env.args={ num_samples = 0 }"], tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1].startswith("error: env.args.num_samples: "), done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing was written
    assert run.DEFAULT_CONFIG == REPO / "configs" / "alphabet_sort_cpu.toml"
    assert (run.DEMO_CHECKPOINT / "config.json").is_file()


def test_the_examples_are_installed_under_their_own_name_and_every_package_is_listed():
    assert Path(rlactors_examples.__file__) == REPO / "examples" / "__init__.py"
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"rlactors_examples": "examples"}
    found = {".".join(init.parent.relative_to(REPO).parts) for init in REPO.glob("rlactors/**/__init__.py")}
    found |= {".".join(("rlactors_examples", *init.parent.relative_to(REPO / "examples").parts))
              for init in (REPO / "examples").glob("**/__init__.py")}
    assert sorted(setuptools["packages"]) == sorted(found)
