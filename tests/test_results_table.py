"""benchmarks/results_table.py: each run adds a dated, commit-stamped row to its table, losing nothing."""

import datetime
import importlib.util
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("results_table", ROOT / "benchmarks" / "results_table.py")
results_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(results_table)

HEADER = "| date | machine | commit | command | size | tokens/s |"


@pytest.fixture
def argv(monkeypatch):
    monkeypatch.setattr("sys.argv", [str(ROOT / "benchmarks" / "bench.py"), "--size", "tiny"])


def test_first_row_creates_the_table_with_date_machine_commit_and_command(tmp_path, argv):
    path = tmp_path / "bench.md"
    results_table.append_row(path, "Bench", ("size", "tokens/s"), ["tiny", "1,234"], device="cpu")
    lines = path.read_text().splitlines()
    assert lines[:4] == ["# Bench", "", HEADER, "|---|---|---|---|---|---|"]
    date, machine, commit, command, size, tokens = (c.strip() for c in lines[4].strip("|").split(" | "))
    assert date == datetime.date.today().isoformat()
    assert machine == f"{results_table.cpu_model()}, {results_table.os.cpu_count()} cores"
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert commit.removesuffix("+changes") == (head.stdout.strip() if head.returncode == 0 else "uncommitted")
    assert command == "`python benchmarks/bench.py --size tiny`"
    assert (size, tokens) == ("tiny", "1,234")
    assert len(lines) == 5


def test_rows_go_under_the_last_row_of_their_table_and_notes_stay_below(tmp_path, argv):
    path = tmp_path / "bench.md"
    old = "| 2026-01-01 | box | before commit tracking | `old` | tiny | 1 |"
    path.write_text(f"# Bench\n\nIntro.\n\n{HEADER}\n|---|---|---|---|---|---|\n{old}\n\n## Notes\n\nKept.\n")
    results_table.append_row(path, "Bench", ("size", "tokens/s"), ["small", "2"], device="cpu")
    results_table.append_row(path, "Bench", ("size", "tokens/s"), ["large", "3"], device="cpu")
    lines = path.read_text().splitlines()
    assert lines[:7] == ["# Bench", "", "Intro.", "", HEADER, "|---|---|---|---|---|---|", old]
    assert lines[7].endswith("| small | 2 |") and lines[8].endswith("| large | 3 |")
    assert lines[9:] == ["", "## Notes", "", "Kept."]


def test_a_file_without_the_table_gets_it_at_the_end(tmp_path, argv):
    path = tmp_path / "bench.md"
    before = "# Bench\n\n| other | header |\n|---|---|\n| a | b |\n"
    path.write_text(before)
    results_table.append_row(path, "Bench", ("size", "tokens/s"), ["tiny", "1"], device="cpu")
    text = path.read_text()
    assert text.startswith(before)
    assert text[len(before):].splitlines()[:3] == ["", HEADER, "|---|---|---|---|---|---|"]


def test_cells_cannot_break_the_table(tmp_path, argv):
    path = tmp_path / "bench.md"
    results_table.append_row(path, "Bench", ("size", "tokens/s"), ["a|b", "two\nlines"], device="cpu")
    assert path.read_text().splitlines()[-1].endswith("| a\\|b | two lines |")


def test_figures_that_do_not_match_the_columns_are_refused_and_the_file_is_kept(tmp_path, argv):
    path = tmp_path / "bench.md"
    path.write_text("# Bench\n")
    with pytest.raises(ValueError, match=r"bench.md: 1 figures for 2 columns"):
        results_table.append_row(path, "Bench", ("size", "tokens/s"), ["tiny"], device="cpu")
    assert path.read_text() == "# Bench\n"


def test_outside_a_git_checkout_the_commit_is_uncommitted(tmp_path, monkeypatch):
    monkeypatch.setattr(results_table, "ROOT", tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert results_table.commit() == "uncommitted"


def test_changed_code_marks_the_commit_and_changed_results_do_not(tmp_path, monkeypatch):
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "code.py").write_text("a = 1\n")
    (tmp_path / "benchmarks" / "results" / "table.md").write_text("# T\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "first")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                          text=True).stdout.strip()
    monkeypatch.setattr(results_table, "ROOT", tmp_path)
    (tmp_path / "benchmarks" / "results" / "table.md").write_text("# T\n| row |\n")
    assert results_table.commit() == head
    (tmp_path / "code.py").write_text("a = 2\n")
    assert results_table.commit() == f"{head}+changes"
