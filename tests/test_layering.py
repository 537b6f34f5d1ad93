"""The packages of rlactors import one another one way only, down the order LAYERS declares (lazy
imports inside functions and imports for type checking count too): a package imports only
packages below it. The modules config, types and vllm_api (rlactors' one door to vLLM) sit below
every package and import none; the entry points train and evaluate sit above them all and no
package imports them."""

import ast
from pathlib import Path

import rlactors

ROOT = Path(rlactors.__file__).parent
PACKAGES = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
MODULES = {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
# Bottom to top: what a run keeps on disk, the model's pieces (LoRA's adapters on top of them), the
# procs' lives, weight sync, then its sending (trainer) and receiving (engines) sides, rollouts, the
# actors, envs and the agent gateway, the run's driver.
LAYERS = ["storage", "attention", "models", "on_policy", "lora", "procs", "weight_sync", "trainer", "engines",
          "rollout", "actors", "envs", "gateway", "run"]
BOTTOM, ENTRY_POINTS = {"config", "types", "vllm_api"}, {"train", "evaluate"}


def arrows() -> dict[tuple[str, str], list[str]]:
    """(importing room, imported room) -> the importing files, from every import statement; a room
    is a package or a top-level module of rlactors."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).parts
        source = parts[0] if len(parts) > 1 else path.stem
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
            for name in names:
                parts = name.split(".")
                if parts[0] == "rlactors" and len(parts) > 1 and parts[1] != source:
                    found.setdefault((source, parts[1]), []).append(str(path.relative_to(ROOT)))
    return found


def test_every_package_has_its_layer():
    assert set(LAYERS) == PACKAGES
    assert BOTTOM | ENTRY_POINTS == MODULES


def test_every_import_runs_down():
    up = {pair: files for pair, files in arrows().items()
          if pair[0] in PACKAGES and pair[1] in PACKAGES and LAYERS.index(pair[0]) < LAYERS.index(pair[1])}
    assert not up, up


def test_the_bottom_modules_import_no_room_and_no_room_imports_an_entry_point():
    found = arrows()
    assert not {pair: files for pair, files in found.items() if pair[0] in BOTTOM and pair[1] != "types"}
    assert not {pair: files for pair, files in found.items() if pair[1] in ENTRY_POINTS and pair[0] not in ENTRY_POINTS}


def test_the_arrows_are_read():
    """The reader sees the imports this file guards: the trainer imports weight sync's packed layout,
    weight sync never imports an engine."""
    found = arrows()
    assert "trainer/gather.py" in found["trainer", "weight_sync"]
    assert ("weight_sync", "engines") not in found and ("engines", "weight_sync") in found


def test_every_package_is_installed():
    """pyproject.toml names the packages a (non-editable) install ships: every one of them."""
    import tomllib

    listed = set(tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert {f"rlactors.{name}" for name in PACKAGES} <= listed
