"""The README is a front page: short, its links and the make targets it quotes exist."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 15_000, f"README.md is {len(text.encode())} bytes (at most 15,000)"
    docs = set(re.findall(r"\]\((docs/[\w.-]+\.md)", text))
    assert len(docs) >= 6, docs


def test_every_relative_link_resolves():
    bad = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http:", "https:", "mailto:", "#")):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target}")
    assert not bad, bad


def test_quoted_make_targets_exist():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"(?m)^([\w-]+):", makefile))
    quoted = {t for page in PAGES for t in re.findall(r"`make ([\w-]+)", page.read_text())}
    assert quoted - targets == set(), quoted - targets


def test_quoted_test_files_exist():
    quoted = {t for page in PAGES for t in re.findall(r"(tests/[\w/]+\.py)", page.read_text())}
    missing = sorted(t for t in quoted if not (ROOT / t).exists())
    assert not missing, missing
