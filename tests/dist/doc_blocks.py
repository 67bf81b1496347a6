"""The commands of README.md, docs/*.md and benchmarks/README.md, and the markers that say how a test runs them.

Every fenced block whose language is `bash`, `sh`, `shell`, `console` or `python` is a *command
block*. tests/dist/test_docs_commands.py runs each one with bash, in order, in one directory per
page (so a page's later blocks see what its earlier ones wrote: train -> export -> translate),
through the cheap `python` / `torchrun` of tests/dist/doc_shell.py (a copy of the repository:
nothing a command writes reaches the checkout). A block runs as written
unless an HTML comment right before it (blank lines allowed between) says otherwise:

    <!-- doc-test skip: REASON -->              one directive on the comment's first line, or
    <!-- doc-test                               one per line
    train: --max_steps 2 --do_eval false
    sub: checkpoint-400 => checkpoint-2
    -->

    train: ARGS       appended to every `trainer.train` launch of the block: direct, under
                      torchrun, through scripts/demo.sh, launch_multinode.sh or sbatch (the later
                      flag wins, so the tiny-scale value replaces the written one)
    sub: OLD => NEW   OLD (which must occur in the block) replaced by NEW before the run; `{port}`
                      in NEW is a free TCP port. For sizes a CPU box cannot have (nodes, GPUs)
    before: COMMAND   run first, in the same shell: inputs the block takes (a data file, a model
                      in the hub cache: the `hf` of the doc tests is tests/dist/doc_fixtures.py)
    after: COMMAND    run last, in the same shell: a check of what the block made, where its
                      exit status says nothing (`wait` after background jobs)
    check: REASON     every `trainer.train` and `trainer.plan` launch is checked, not run: its
                      flags parsed and the job validated for its world size (torchrun's nodes x
                      processes, the planner's --world_size), the trainer's own first step; for
                      GPU-sized jobs and repeats of a job already run. The block must launch at
                      least one; its other commands run.
    skip: REASON      not run at all: only where no tiny form exists (the REASON says why)
    timeout: SECONDS  the block's limit (default `DEFAULT_TIMEOUT_S`)

`console` blocks run their `$ `-prefixed lines only; `python` blocks run as `python -` on the
block. A block without a marker that cannot run here fails the test, so a new command cannot
slip past it. Pure: this module starts nothing.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LANGUAGES = ("bash", "sh", "shell", "console", "python")
DIRECTIVES = ("train", "sub", "before", "after", "check", "skip", "timeout")
DEFAULT_TIMEOUT_S = 180
MARKER = "doc-test"
_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)\s*$")


class MarkerError(ValueError):
    """A doc-test marker that cannot be used; the message names the page, the line and why."""


@dataclass
class Block:
    """One command block of a page and its marker's directives."""

    page: str  # path relative to the repository
    line: int  # the opening fence's line, 1-based
    language: str
    text: str
    train: list[str] = field(default_factory=list)
    subs: list[tuple[str, str]] = field(default_factory=list)
    before: list[str] = field(default_factory=list)
    after: list[str] = field(default_factory=list)
    check: str | None = None
    skip: str | None = None
    timeout: float = DEFAULT_TIMEOUT_S

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def script(self, port: int = 0) -> str:
        """The bash script that runs the block at tiny scale (markers applied)."""
        text = self.text
        for old, new in self.subs:
            text = text.replace(old, new.replace("{port}", str(port)))
        if self.language == "console":
            text = "\n".join(ln[2:] for ln in text.splitlines() if ln.startswith("$ "))
        elif self.language == "python":
            text = f"python - <<'DOC_TEST_PYTHON_EOF'\n{text}\nDOC_TEST_PYTHON_EOF"
        return "\n".join(["set -euo pipefail", *self.before, text, *self.after]) + "\n"


def doc_pages(root: Path = ROOT) -> list[Path]:
    """README.md, docs/*.md in name order, benchmarks/README.md: the pages whose commands must run."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md")), root / "benchmarks" / "README.md"]


def _directives(block: Block, comment: str) -> None:
    body = comment.strip()[len("<!--") : -len("-->")].strip()
    assert body.startswith(MARKER)
    lines = [ln.strip() for ln in body[len(MARKER) :].splitlines()]
    for ln in (ln for ln in lines if ln):
        name, sep, value = ln.partition(":")
        name, value = name.strip(), value.strip()
        if not sep or name not in DIRECTIVES:
            raise MarkerError(f"{block.where}: unknown doc-test directive {ln!r}; known: {', '.join(DIRECTIVES)}")
        if name in ("check", "skip") and len(value.split()) < 3:
            raise MarkerError(f"{block.where}: `{name}:` needs a reason of a few words, got {value!r}")
        if name == "train":
            block.train += shlex.split(value)
        elif name == "sub":
            old, arrow, new = value.partition("=>")
            if not arrow or not old.strip():
                raise MarkerError(f"{block.where}: `sub:` is `sub: OLD => NEW`, got {value!r}")
            if old.strip() not in block.text:
                raise MarkerError(f"{block.where}: `sub:` {old.strip()!r} does not occur in the block")
            block.subs.append((old.strip(), new.strip()))
        elif name in ("before", "after"):
            getattr(block, name).append(value)
        elif name == "timeout":
            block.timeout = float(value)
        else:
            setattr(block, name, value)
    if block.skip and (block.train or block.subs or block.before or block.after or block.check):
        raise MarkerError(f"{block.where}: a skipped block takes no other directive")


def read_blocks(page: Path, root: Path = ROOT) -> list[Block]:
    """The command blocks of `page` with their markers, in order.

    Raises:
        MarkerError: a marker not followed by a command block, an unknown directive, a `sub:`
            whose text is not in its block, a `skip:` or `check:` without a reason, an unclosed fence.
    """
    rel = str(page.relative_to(root))
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    pending: tuple[int, str] | None = None  # (line, comment) of a marker waiting for its block
    i = 0
    while i < len(lines):
        ln = lines[i]
        if ln.lstrip().startswith("<!--") and MARKER in ln.split("-->")[0][:20]:
            start = i
            while "-->" not in lines[i]:
                i += 1
                if i == len(lines):
                    raise MarkerError(f"{rel}:{start + 1}: unclosed doc-test marker")
            if pending is not None:
                raise MarkerError(f"{rel}:{pending[0]}: doc-test marker without a command block after it")
            pending = (start + 1, "\n".join(lines[start : i + 1]))
            i += 1
            continue
        m = _FENCE.match(ln)
        if m:
            fence, lang = m.group(2), m.group(3).lower()
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(fence):
                j += 1
            if j == len(lines):
                raise MarkerError(f"{rel}:{i + 1}: unclosed code fence")
            if lang in LANGUAGES:
                block = Block(rel, i + 1, lang, "\n".join(lines[i + 1 : j]))
                if pending is not None:
                    _directives(block, pending[1])
                blocks.append(block)
            elif pending is not None:
                raise MarkerError(f"{rel}:{pending[0]}: doc-test marker before a `{lang}` block, not a command block")
            pending = None
            i = j + 1
            continue
        if ln.strip() and pending is not None:
            raise MarkerError(f"{rel}:{pending[0]}: doc-test marker without a command block right after it")
        i += 1
    if pending is not None:
        raise MarkerError(f"{rel}:{pending[0]}: doc-test marker without a command block after it")
    return blocks
