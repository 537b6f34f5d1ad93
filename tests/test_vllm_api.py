"""rlactors.vllm_api is the one door to vLLM: no other module imports vllm, the names taken through
it are the names it declares, it imports only those (each from its declared module, after the
version check), and an unsupported vLLM fails at its first use with one line naming the range.
All on CPU: stand-in vLLM modules, no vLLM installed."""

from __future__ import annotations

import ast
import functools
import re
import sys
import tomllib
import types
from pathlib import Path

import pytest
import torch

from rlactors import vllm_api

REPO = Path(vllm_api.__file__).parent.parent
SOURCES = sorted(p for folder in ("rlactors", "benchmarks", "scripts", "examples")
                 for p in (REPO / folder).rglob("*.py"))
API = Path(vllm_api.__file__)


@functools.cache
def _trees() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text()) for path in SOURCES}


def _is_vllm(module: str | None) -> bool:
    return module is not None and module.split(".")[0] == "vllm"


def test_no_module_but_vllm_api_imports_vllm():
    found = []
    for path, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [f"{path}: import {a.name}" for a in node.names if _is_vllm(a.name)]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_vllm(node.module):
                found.append(f"{path}: from {node.module}")
            elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                  and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
                  and _is_vllm(str(node.args[0].value)) and path != API):
                found.append(f"{path}: import_module({node.args[0].value!r})")
    assert not found, found


def _names_taken() -> set[str]:
    """Every name taken from vllm_api: `from rlactors.vllm_api import X` and `vllm_api.X` elsewhere,
    `_load("X")` inside it."""
    taken = set()
    for tree in _trees().values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "rlactors.vllm_api":
                taken |= {a.name for a in node.names}
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "vllm_api":
                taken.add(node.attr)
            elif isinstance(node, ast.Call) and ast.unparse(node.func) == "_load" and isinstance(node.args[0],
                                                                                                ast.Constant):
                taken.add(node.args[0].value)
    return taken


def test_the_vllm_names_taken_through_it_are_the_names_it_declares():
    own = set(vars(vllm_api))  # its own functions and constants
    taken = _names_taken()
    assert {"LLMEngine", "compute_token_logprobs", "StatelessProcessGroup", "shut_down"} <= taken  # the scan reads
    assert taken - own == set(vllm_api.NAMES)


def test_it_has_no_import_of_vllm_but_the_declared_modules():
    """Its only way to vLLM is `importlib.import_module`, of "vllm" (the version) or a module of NAMES."""
    tree = ast.parse(API.read_text())
    imports = [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]
    assert not [node for node in imports if _is_vllm(getattr(node, "module", None))
                or any(_is_vllm(a.name) for a in node.names)]
    calls = [ast.unparse(node) for node in ast.walk(tree)
             if isinstance(node, ast.Call) and ast.unparse(node.func) == "importlib.import_module"]
    assert sorted(calls) == ["importlib.import_module('vllm')", "importlib.import_module(NAMES[name])"]


def fake_vllm(monkeypatch, version: str = vllm_api.SUPPORTED[0], names: bool = True) -> None:
    """Stand-in vLLM modules in sys.modules: "vllm" of `version` and, with `names`, every declared
    module holding its declared names (each valued "module.name") and an undeclared one. Any other
    vLLM module fails to import ("vllm" is no package)."""
    modules = {module: types.ModuleType(module) for module in {"vllm", *vllm_api.NAMES.values()}}
    modules["vllm"].__version__ = version
    for name, module in vllm_api.NAMES.items():
        setattr(modules[module], name, f"{module}.{name}")
        setattr(modules[module], f"not_{name}", "undeclared")
    for module in modules if names else ["vllm"]:
        monkeypatch.setitem(sys.modules, module, modules[module])


def test_each_name_comes_from_its_declared_module(monkeypatch):
    fake_vllm(monkeypatch)
    for name, module in vllm_api.NAMES.items():
        assert getattr(vllm_api, name) == f"{module}.{name}"
    from rlactors.vllm_api import RequestOutputKind  # as the engine takes it

    assert RequestOutputKind == "vllm.sampling_params.RequestOutputKind"
    with pytest.raises(AttributeError, match="not_LLMEngine"):
        vllm_api.not_LLMEngine  # noqa: B018
    with pytest.raises(ImportError):
        from rlactors.vllm_api import ParallelConfig  # noqa: F401


def test_an_unsupported_vllm_fails_at_its_first_use_naming_the_range(monkeypatch):
    fake_vllm(monkeypatch, "0.26.0", names=False)  # no logprob module: imported before the check, it would fail
    with pytest.raises(vllm_api.UnsupportedVLLM) as failed:
        from rlactors.vllm_api import compute_token_logprobs  # noqa: F401
    assert str(failed.value) == "rlactors supports vLLM >=0.31.0,<0.32.0; vLLM 0.26.0 is installed"


@pytest.mark.parametrize(("version", "supported"), [
    ("0.31.0", True), ("0.31.2", True), ("0.31.1.dev3+g0123abc", True),
    ("0.30.9", False), ("0.32.0", False), ("0.32.0rc1", False), ("0.26.0", False), ("1.0.0", False), ("dev", False)])
def test_the_supported_range(version, supported):
    if supported:
        vllm_api.check_version(version)
    else:
        with pytest.raises(vllm_api.UnsupportedVLLM, match=re.escape(f"; vLLM {version} is installed")):
            vllm_api.check_version(version)


def test_the_gpu_extra_pins_a_supported_vllm():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = [spec.removeprefix("vllm==") for spec in extras["gpu"] if spec.startswith("vllm==")]
    assert len(pins) == 1
    vllm_api.check_version(pins[0])


def test_worker_model_is_the_model_a_worker_runs():
    model = torch.nn.Linear(1, 1)
    assert vllm_api.worker_model(types.SimpleNamespace(get_model=lambda: model)) is model
    assert vllm_api.worker_model(types.SimpleNamespace(model_runner=types.SimpleNamespace(model=model))) is model

