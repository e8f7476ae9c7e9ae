"""Documentation, scripts and comments speak of the project alone: no talk of the machines, tools, tickets or
folders outside the repository that some of it was written beside."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = {".py", ".md", ".sh", ".toml", ".txt", ".cfg", ".yml", ".yaml"}
SKIP_DIRS = {".git", "runs", "__pycache__", ".pytest_cache"}
# spelled in pieces so that this file does not match itself
FORBIDDEN = [
    r"\bissue\s*#?\s*\d",  # ticket numbers
    r"\.\./" + "shared",  # folders beside the repository
    r"nvidia-h200" + r"-x\d|nvidia-h200\b",  # machine kinds of a lending service
    r"device " + "tool",
    r"\blent\b",
    r"\bsession \d",
]


def _text_files():
    for path in sorted(ROOT.rglob("*")):
        if path.suffix in SUFFIXES and path.is_file() and not SKIP_DIRS & set(path.relative_to(ROOT).parts):
            yield path


def test_no_outside_references():
    pattern = re.compile("|".join(FORBIDDEN), re.IGNORECASE)
    hits = []
    for path in _text_files():
        if path == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert hits == [], "\n".join(hits)


def test_the_check_catches_a_ticket_number():
    assert re.search("|".join(FORBIDDEN), "see Issue 8 for the run", re.IGNORECASE)
