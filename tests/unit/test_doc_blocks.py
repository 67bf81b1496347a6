"""The docs' structure, checked without running anything (the commands run in
tests/dist/test_docs_commands.py, slow tier).

- every doc-test marker of README.md, docs/*.md and benchmarks/README.md parses: a known
  directive, a reason for `skip:` / `check:`, a `sub:` whose text is in its block, a command
  block right after it (tests/dist/doc_blocks.py);
- the README stays a front page (at most `README_MAX_LINES` lines) that indexes every docs page;
- every relative link resolves to a file, and its `#anchor` to a heading of that file.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.dist.doc_blocks import ROOT, Block, MarkerError, doc_pages, read_blocks

README_MAX_LINES = 200
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    out, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(slug(line.lstrip("#")))
    return out


@pytest.mark.parametrize("page", [str(p.relative_to(ROOT)) for p in doc_pages()])
def test_markers_parse(page: str) -> None:
    blocks = read_blocks(ROOT / page)
    for b in blocks:
        assert b.text.strip(), f"{b.where}: empty command block"


def test_a_bad_marker_is_an_error(tmp_path: Path) -> None:
    page = tmp_path / "README.md"
    cases = {
        "<!-- doc-test fly: away -->\n```bash\necho\n```\n": "unknown doc-test directive",
        "<!-- doc-test skip: no -->\n```bash\necho\n```\n": "needs a reason",
        "<!-- doc-test sub: absent => x -->\n```bash\necho\n```\n": "does not occur",
        "<!-- doc-test skip: not run here at all -->\n\ntext\n```bash\necho\n```\n": "without a command block",
        "<!-- doc-test skip: not run here at all -->\n```yaml\na: 1\n```\n": "not a command block",
    }
    for text, message in cases.items():
        page.write_text(text)
        with pytest.raises(MarkerError, match=message):
            read_blocks(page, tmp_path)


def test_markers_apply(tmp_path: Path) -> None:
    page = tmp_path / "README.md"
    page.write_text(
        "<!-- doc-test\ntrain: --max_steps 2\nsub: checkpoint-400 => checkpoint-2\nbefore: mkdir -p x\n-->\n"
        "```bash\npython -m trainer.export --checkpoint out/checkpoint-400\n```\n\n"
        "```console\n$ echo hi\nhi\n```\n"
    )
    first, second = read_blocks(page, tmp_path)
    assert isinstance(first, Block) and first.train == ["--max_steps", "2"]
    assert first.script().splitlines()[1:] == [
        "mkdir -p x",
        "python -m trainer.export --checkpoint out/checkpoint-2",
    ]
    assert second.script().splitlines()[1:] == ["echo hi"]


def test_readme_is_a_front_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES, f"README.md has {len(readme.splitlines())} lines"
    assert readme.index("scripts/demo.sh") < readme.index("## Launching"), "the set-up commands come first"
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text(), (
        ".ci/run must run the README's test command"
    )
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"(docs/{p.name})" not in readme]
    assert not missing, f"README.md's index lacks {missing}"


@pytest.mark.parametrize("page", [str(p.relative_to(ROOT)) for p in doc_pages()])
def test_relative_links_resolve(page: str) -> None:
    path = ROOT / page
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    bad = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{page}: " + "; ".join(bad)
