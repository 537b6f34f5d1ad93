"""The README and docs/ as a newcomer reads them: their code runs as written, the paths they name
exist, and they hold no commit ids or dates (those live in docs/status.md and benchmarks/results/).

A fenced block runs unless the line before it is `<!-- not run: why -->`:
python blocks are executed (not-run ones compiled), toml blocks parsed (a run config's sections
checked), bash blocks run in the repository root (not-run ones: every script, module and config
they name must exist). `make test` builds docs/ as a site in strict mode (mkdocs.yml), which
checks the links between pages.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest

from rlactors.config import Config

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<skip><!-- not run: [^\n]*-->\n)?```(?P<lang>\w*)\n(?P<code>.*?)^```$", re.M | re.S)
STATUS = ROOT / "docs" / "status.md"
# 7 to 40 hex digits with a letter and a digit among them (a commit id), and ISO dates.
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
# Paths a page names in backticks, under the repository's own directories.
NAMED_PATH = re.compile(r"`((?:rlactors|examples|configs|tests|benchmarks|scripts|docs)/[\w./-]*\w/?)`")


def blocks(page: Path) -> list[tuple[str, str, bool]]:
    """(language, code, runs) of each fenced block of `page`."""
    return [(m["lang"], m["code"], not m["skip"]) for m in FENCE.finditer(page.read_text())]


def _block_ids(lang: str) -> list:
    return [pytest.param(page, code, runs, id=f"{page.name}:{i}")
            for page in PAGES for i, (block_lang, code, runs) in enumerate(blocks(page)) if block_lang == lang]


def test_every_page_has_fenced_blocks_this_test_reads():
    assert any(lang == "python" for page in PAGES for lang, _, _ in blocks(page))
    # A block without a language would escape every check below.
    for page in PAGES:
        assert all(lang for lang, _, _ in blocks(page)), f"{page.name}: a fenced block without a language"


@pytest.mark.parametrize("page,code,runs", _block_ids("python"))
def test_python_blocks_run(page, code, runs, monkeypatch):
    compiled = compile(code, str(page), "exec", dont_inherit=True)  # as the page's own module
    if runs:
        monkeypatch.chdir(ROOT)  # the pages' paths are the repository's
        module = types.ModuleType(f"doc_snippet_{page.stem}")
        monkeypatch.setitem(sys.modules, module.__name__, module)
        exec(compiled, module.__dict__)  # noqa: S102 - the page's own code


@pytest.mark.parametrize("page,code,runs", _block_ids("toml"))
def test_toml_blocks_parse_as_config_sections(page, code, runs):
    tree = tomllib.loads(code)
    sections = {f.name for f in dataclasses.fields(Config)}
    assert set(tree) <= sections, f"{page.name}: sections {set(tree) - sections} are not config sections"


def _commands(code: str) -> list[list[str]]:
    """Each command of a shell block, its continuation lines joined and comments dropped."""
    joined = code.replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in joined.splitlines() if shlex.split(line, comments=True)]


@pytest.mark.parametrize("page,code,runs", _block_ids("bash"))
def test_bash_blocks_name_what_exists(page, code, runs, tmp_path):
    for words in _commands(code):
        named = [piece for word in words for piece in re.split(r"[\s=]", word)]  # ARGS="--config FILE" too
        for word in named:
            if word.endswith((".py", ".sh", ".toml")) and "/" in word and not word.startswith("/"):
                assert (ROOT / word).exists(), f"{page.name}: `{' '.join(words)}` names {word}, which is not there"
        for i, word in enumerate(words):
            if word == "-m" and i + 1 < len(words) and words[i + 1].startswith("rlactors"):
                assert importlib.util.find_spec(words[i + 1]), f"{page.name}: no module {words[i + 1]}"
    if runs:
        # `python` is this venv's; what a block writes under mktemp goes to this test's tmp_path.
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               "TMPDIR": str(tmp_path)}
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, f"{page.name}:\n{code}\n{done.stderr[-2000:]}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_paths_a_page_names_exist(page):
    text = page.read_text()
    missing = [p for p in NAMED_PATH.findall(text) if not any(c in p for c in "*{<")
               and not (ROOT / p).exists()]
    assert not missing, f"{page.name} names paths that are not there: {missing}"


def test_readme_links_reach_files_and_headings():
    text = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(((?!https?:)[^)]+)\)", text):
        path, _, anchor = target.partition("#")
        assert (ROOT / path).exists(), f"README.md links to {path}, which is not there"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h.lower()).strip().replace(" ", "-") for h in headings}
            assert anchor in {re.sub("-+", "-", s) for s in slugs}, f"README.md links to {target}: no such heading"


@pytest.mark.parametrize("page", [p for p in PAGES if p != STATUS], ids=lambda p: p.name)
def test_guides_hold_no_commit_ids_or_dates(page):
    text = page.read_text()
    assert not COMMIT.findall(text), f"{page.name}: commit ids {COMMIT.findall(text)} (they go in docs/status.md)"
    assert not DATE.findall(text), f"{page.name}: dates {DATE.findall(text)} (they go in docs/status.md)"


def test_readme_stays_a_guide():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_readme_env_example_loads_with_the_config_it_suggests(tmp_path, monkeypatch):
    """The README's env, saved where it says, passes every check a run makes before it spawns a
    proc, with the command line the README gives (the newcomer's path)."""
    from rlactors.config import load_config
    from rlactors.models import load_checked_tokenizer
    from rlactors.rollout import load_env
    from rlactors.run.evaluation import training_evaluator

    readme = ROOT / "README.md"
    (env_code,) = [code for lang, code, _ in blocks(readme) if lang == "python" and "class EchoEnv" in code]
    (command,) = [words for lang, code, _ in blocks(readme) if lang == "bash" for words in _commands(code)
                  if "env.name=my_envs.echo:EchoEnv" in words]
    (tmp_path / "my_envs").mkdir()
    (tmp_path / "my_envs" / "echo.py").write_text(env_code)
    config_file = command[command.index("--config") + 1]
    overrides = [w for w in command[command.index("--config") + 2:] if "=" in w]
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(ROOT)  # where the README's command runs
    config = load_config(config_file, overrides)
    env = load_env(config.env, load_checked_tokenizer(config.model.path))
    assert env.config.word == "hi"
    assert len(env.dataset("train")) > 0
    assert training_evaluator(env, config, generate=None) is not None


def test_status_page_lists_the_latest_run_of_each_results_table():
    spec = importlib.util.spec_from_file_location("status_page", ROOT / "scripts" / "status_page.py")
    status_page = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(status_page)
    assert STATUS.read_text() == status_page.page(), "docs/status.md is out of date: python scripts/status_page.py"
    latest = dict(status_page.latest_runs())
    # The newest of a table's dates wins, wherever its row sits.
    table = (ROOT / "benchmarks" / "results" / "weight_sync.md").read_text().splitlines()
    dates = [line.split(" | ")[0].strip("| ") for line in table if line.startswith("| 20")]
    assert latest["weight_sync.md"][0] == max(dates)


MAX_DOCSTRING_LINES = 15  # protocol prose goes to docs/ARCHITECTURE.md


def test_every_module_says_what_it_is_in_at_most_15_lines():
    import ast

    package = ROOT / "rlactors"
    lengths = {}
    for path in sorted(package.rglob("*.py")):
        name, source = path.relative_to(package).as_posix(), path.read_text()
        if not source.strip():
            continue
        docstring = ast.get_docstring(ast.parse(source), clean=False)
        lengths[name] = len(docstring.splitlines()) if docstring else 0
    assert "run/controller.py" in lengths and len(lengths) > 80
    assert not {name: n for name, n in lengths.items() if not 0 < n <= MAX_DOCSTRING_LINES}
