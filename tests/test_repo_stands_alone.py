"""The repository stands alone: no file points at a document outside it (a design page, paper
summaries or issue threads that only the authors had, or a path of the machine it was written on).
The why belongs in docs/design.md, papers are cited by title and arXiv id (docs/papers.md)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("mcore_rl", "tests", "tools", "benchmarks", "launch", "configs", "docs", ".ci")
TOP_FILES = ("README.md", "pyproject.toml")
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".sbatch", ".toml", ".txt", ""}

OUTSIDE = re.compile(
    r"DESIGN\.md|seed_[ABC{]|anchors\.md|reference/seed|megatron-core-on-cpu\.md|\.\./shared"
    r"|/work/|[Ii]ssue #?\d+|paper notes|\bthe notes\b"
)


def _files() -> list[Path]:
    out = [ROOT / f for f in TOP_FILES]
    for top in SCANNED:
        for p in sorted((ROOT / top).rglob("*")):
            if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts:
                out.append(p)
    return [p for p in out if p.exists() and p != Path(__file__).resolve()]


def outside_references(files: list[Path], root: Path = ROOT) -> list[str]:
    """`file:line: match` for every line that names a document outside the repository."""
    found = []
    for p in files:
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), start=1):
            m = OUTSIDE.search(line)
            if m:
                found.append(f"{p.relative_to(root)}:{n}: {m.group(0)!r}")
    return found


def test_no_file_points_outside_the_repository():
    found = outside_references(_files())
    assert not found, "references to documents outside the repository:\n" + "\n".join(found)


def test_the_check_finds_what_it_looks_for(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text('"""Spec in reference/seed_C.md (DESIGN.md decision 4).\n\nSee issue 12."""\nok = 1\n')
    assert outside_references([bad], tmp_path) == ["x.py:1: 'reference/seed'", "x.py:3: 'issue 12'"]


def test_every_relative_link_of_the_docs_resolves():
    """A page moved or renamed leaves no dead link in the README or docs/."""
    link = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")
    dead = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for n, line in enumerate(page.read_text().splitlines(), start=1):
            for m in link.finditer(line):
                target = m.group(1)
                if not target.startswith(("http://", "https://", "mailto:")) and not (page.parent / target).exists():
                    dead.append(f"{page.relative_to(ROOT)}:{n}: {target}")
    assert not dead, "dead links:\n" + "\n".join(dead)
