"""The model, attention, true on-policy, trainer and engine packages import one another one way
only (lazy imports inside functions count too): the plain model and the trainer stay below the
engines and the true on-policy package."""

import ast
from pathlib import Path

import rlactors

ROOT = Path(rlactors.__file__).parent
PACKAGES = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
LAYERED = {"attention", "models", "on_policy", "trainer", "engines"}


def package_arrows() -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> the importing modules, from every import statement."""
    arrows: dict[tuple[str, str], list[str]] = {}
    for path in ROOT.rglob("*.py"):
        source = path.relative_to(ROOT).parts[0]
        if source not in PACKAGES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
            for name in names:
                parts = name.split(".")
                if parts[0] == "rlactors" and len(parts) > 1 and parts[1] in PACKAGES and parts[1] != source:
                    arrows.setdefault((source, parts[1]), []).append(str(path.relative_to(ROOT)))
    return arrows


def test_no_two_of_these_packages_import_each_other():
    arrows = package_arrows()
    assert LAYERED <= PACKAGES
    both_ways = {tuple(sorted(pair)): (arrows[pair], arrows[pair[::-1]])
                 for pair in arrows if pair[::-1] in arrows and set(pair) <= LAYERED}
    assert not both_ways, both_ways


def test_the_model_and_the_trainer_import_no_engine():
    arrows = package_arrows()
    for low, high in [("models", "on_policy"), ("models", "engines"), ("attention", "models"),
                      ("trainer", "engines"), ("on_policy", "engines"), ("on_policy", "trainer")]:
        assert (low, high) not in arrows, arrows[low, high]


def test_every_package_is_installed():
    """pyproject.toml names the packages a (non-editable) install ships: every one of them."""
    import tomllib

    listed = set(tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert {f"rlactors.{name}" for name in PACKAGES} <= listed
