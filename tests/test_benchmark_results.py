"""The committed benchmark results can be traced: every current result names the commit it measured, the results
folder holds its index and topic folders only, and every results file the docs and comments cite exists."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
COMMIT = re.compile(r"^[0-9a-f]{7,40}$")
MD_COMMIT = re.compile(r"^Commit: `([0-9a-f]{7,40})`", re.MULTILINE)
# a results file named in prose: benchmarks/results/<path> or results/<path>, ending in .md, .json or .log
CITED = re.compile(r"(?<![\w/])(?:benchmarks/)?results/([\w./-]+?\.(?:md|json|log))(?![\w*{])")


def missing_commit(path: Path) -> bool:
    """True when a results file (JSON: "commit" at the top level or in "meta"; markdown: a "Commit: `<hash>`" line)
    does not name the commit it measured."""
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
        value = data.get("commit") or data.get("meta", {}).get("commit") if isinstance(data, dict) else None
        return not (isinstance(value, str) and COMMIT.match(value))
    return MD_COMMIT.search(text) is None


def current_results() -> list[Path]:
    return [
        p
        for p in sorted(RESULTS.rglob("*"))
        if p.suffix in (".json", ".md") and p.name != "README.md" and "archive" not in p.relative_to(RESULTS).parts
    ]


def test_every_current_result_names_its_commit():
    files = current_results()
    assert len(files) > 50
    lacking = [str(p.relative_to(ROOT)) for p in files if missing_commit(p)]
    assert lacking == [], "results without a commit (benchmarks/README.md, 'Commits'):\n" + "\n".join(lacking)


def test_the_commit_check_fails_without_one(tmp_path):
    cases = {
        "named.md": ("# t\n\n2026-12-01, H200\n\nCommit: `0123abc`\n", False),
        "unnamed.md": ("# t\n\n2026-12-01, H200\n\nCommand: `python x.py`\n", True),
        "unknown.md": ("# t\n\nCommit: `unknown`\n", True),
        "meta.json": (json.dumps({"meta": {"commit": "0123abcdef"}, "rows": []}), False),
        "top.json": (json.dumps({"commit": "0123abc", "rows": []}), False),
        "none.json": (json.dumps({"meta": {"date": "2026-12-01"}, "rows": []}), True),
        "unknown.json": (json.dumps({"meta": {"commit": "unknown"}}), True),
    }
    for name, (text, lacks) in cases.items():
        (tmp_path / name).write_text(text)
        assert missing_commit(tmp_path / name) is lacks, name


def test_results_top_level_is_the_index_and_topic_folders():
    loose = [p.name for p in RESULTS.iterdir() if p.is_file() and p.name != "README.md"]
    assert loose == [], f"results files outside a topic folder (benchmarks/results/README.md): {loose}"
    assert (RESULTS / "README.md").is_file() and (RESULTS / "archive").is_dir()


def _citing_files():
    yield ROOT / "README.md"
    yield from sorted((ROOT / "docs").glob("*.md"))
    yield from sorted((ROOT / "benchmarks").glob("*.py"))
    yield from sorted((ROOT / "benchmarks").glob("*.md"))
    yield from sorted((ROOT / "xmoe").rglob("*.py"))
    yield from sorted((ROOT / "xmoe" / "kernels" / "tuned").glob("*.json"))


def test_cited_results_files_exist():
    dangling = []
    for path in _citing_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in CITED.finditer(line):
                if not (RESULTS / match.group(1)).is_file():
                    dangling.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)}")
    assert dangling == [], "\n".join(dangling)


def test_index_links_resolve():
    index = (RESULTS / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#]+)\)", index)
    assert len(targets) > 20
    dangling = [t for t in targets if not t.startswith("http") and not (RESULTS / t).exists()]
    assert dangling == [], dangling


def test_the_commit_is_dirty_for_changed_code_not_for_changed_results(tmp_path, monkeypatch):
    """harness.commit() calls a tree dirty when tracked code differs from HEAD, not when saved results do: results
    written one after another (a run, then its --repredict) name their code alike."""
    import subprocess

    from benchmarks import harness

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True)

    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    code, result = tmp_path / "model.py", tmp_path / "benchmarks" / "results" / "run.md"
    code.write_text("x = 1\n")
    result.write_text("# run\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "start")
    monkeypatch.setattr(harness, "ROOT", tmp_path)
    assert harness.commit()["commit_dirty"] is False
    result.write_text("# run, predicted again\n")
    assert harness.commit()["commit_dirty"] is False
    code.write_text("x = 2\n")
    assert harness.commit()["commit_dirty"] is True
