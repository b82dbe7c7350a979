"""`python -m bench run`: where results go, and that the committed ones change only when asked."""
from pathlib import Path

import pytest

import bench
from bench.__main__ import main
from bench.harness import OUT_DIR, RESULTS_DIR


@pytest.fixture
def seen(monkeypatch):
    calls = []
    monkeypatch.setattr(bench, "run_benchmark", lambda name, options: calls.append((name, options)) or 0)
    return calls


def test_quick_run_writes_to_the_ignored_folder(seen):
    assert main(["run", "--quick"]) == 0
    assert [name for name, _ in seen] == list(bench.DEFAULT_BENCHMARKS)
    options = seen[0][1]
    assert options.quick and options.out_dir == OUT_DIR and options.update_readme is None
    assert options.repeats == 3 and options.command == "python -m bench run --quick"


def test_update_results_is_the_full_grid_into_the_committed_folder(seen):
    assert main(["run", "--update-results", "cross_attention"]) == 0
    (name, options), = seen
    assert name == "cross_attention" and not options.quick and options.repeats == 5
    assert options.out_dir == RESULTS_DIR and options.update_readme == Path("README.md")


@pytest.mark.parametrize("args", [["--update-results", "--quick"], ["--update-results", "--out", "x"], ["nope"]])
def test_refused(seen, args, capsys):
    assert main(["run", *args]) == 2 and not seen
    assert "error" in capsys.readouterr().err


def test_gitignore_covers_the_default_output():
    root = Path(__file__).resolve().parents[2]
    assert f"{OUT_DIR.as_posix()}/" in (root / ".gitignore").read_text().splitlines()


def test_publish_writes_the_full_block_and_gives_the_readme_the_summary(tmp_path, capsys):
    from bench.harness.report import publish

    readme = tmp_path / "README.md"
    readme.write_text("a\n<!-- bench:x:start -->\nold\n<!-- bench:x:end -->\nb\n")
    assert publish("x", "FULL TABLE", {"k": 1}, tmp_path / "out", readme=readme, summary="SHORT")
    assert (tmp_path / "out" / "x.md").read_text() == "# x benchmark\n\nFULL TABLE\n"
    assert (tmp_path / "out" / "x.json").exists()
    assert readme.read_text() == "a\n<!-- bench:x:start -->\nSHORT\n<!-- bench:x:end -->\nb\n"  # absolute out_dir
