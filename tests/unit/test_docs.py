"""The docs point at what exists: every relative link, and every csi-qsd flag they name.

Pure file reading. A link in any Markdown file of the repository (README.md, docs/, deploy/, …)
must name a file or directory that exists and, with `#anchor`, a heading of that page as GitHub
spells anchors. A flag the docs give to csi-qsd must be an option of the parser
`csi_qsd.cli.build_parser` builds: flags on a command line that runs csi-qsd (`csi-qsd …`,
`.venv/bin/csi-qsd …`, `scripts/run.sh …`, in a shell code block or a code span), flag spans on a
line that has such a span (so other tools' flags stay off those lines), and the first column of
every table row that pairs a flag with a `CSI_QSD_*` variable (the variable must be the flag's).
A flag given to a benchmark (`python -m e2e.bench.NAME …`) must be one its module, or a bench
module it imports, adds. Other tools' flags (fio, kubectl, qemu-img, pytest, …) are not checked.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote

from csi_qsd import cli

REPO = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO / "e2e" / "bench"
SKIPPED_DIRS = frozenset({"build", "node_modules", "__pycache__"})


def markdown_files(root: Path = REPO) -> list[Path]:
    """The repository's Markdown files, leaving out hidden directories (.venv, .runtime, .git, …)."""
    found = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS
                         and not d.endswith(".egg-info"))
        found += [Path(directory) / name for name in sorted(files) if name.endswith(".md")]
    return found


# ---------------------------------------------------------------------------
# Reading Markdown


FENCE = re.compile(r"^\s*(```|~~~)\s*(\w*)")
SHELL = frozenset({"", "sh", "bash", "shell", "console", "zsh"})
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"`([^`]+)`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)


@dataclass
class Page:
    """A Markdown file split into its prose (code blocks blanked) and its shell code blocks' lines."""

    path: Path
    prose: list[str] = field(default_factory=list)
    code: list[str] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> Page:
        page = cls(path)
        fence, shell = "", False
        for line in path.read_text(encoding="utf-8").splitlines():
            match = FENCE.match(line)
            if fence:
                if match and match.group(1) == fence and not match.group(2):
                    fence = ""
                elif shell:
                    page.code.append(line)
                page.prose.append("")
            elif match:
                fence, shell = match.group(1), match.group(2) in SHELL
                page.prose.append("")
            else:
                page.prose.append(line)
        return page

    def anchors(self) -> set[str]:
        """The anchors of the page's headings, numbered as GitHub numbers repeated ones."""
        seen: dict[str, int] = {}
        anchors = set()
        for line in self.prose:
            match = HEADING.match(line)
            if not match:
                continue
            anchor = github_anchor(match.group(1))
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            anchors.add(anchor if count == 0 else f"{anchor}-{count}")
        return anchors


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


# ---------------------------------------------------------------------------
# (a) Links


def link_targets(page: Page) -> Iterator[str]:
    """Every link target in the page's prose, code spans left out."""
    text = CODE_SPAN.sub(lambda m: " " * len(m.group(0)), "\n".join(page.prose))
    yield from LINK.findall(text)
    yield from REFERENCE.findall(text)


def link_problems(paths: list[Path], root: Path = REPO) -> list[str]:
    pages: dict[Path, Page] = {}

    def page(path: Path) -> Page:
        if path not in pages:
            pages[path] = Page.read(path)
        return pages[path]

    problems = []
    for path in paths:
        for target in link_targets(page(path)):
            if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", target):  # https:, mailto:, …
                continue
            file_part, _, anchor = target.partition("#")
            where = f"{path.relative_to(root)}: ({target})"
            linked = (path.parent / unquote(file_part)).resolve() if file_part else path
            if not linked.exists():
                problems.append(f"{where}: no file {file_part}")
            elif anchor and linked.suffix == ".md" and unquote(anchor) not in page(linked).anchors():
                problems.append(f"{where}: no heading #{anchor} in {linked.relative_to(root)}")
    return problems


def test_every_relative_link_resolves() -> None:
    problems = link_problems(markdown_files())
    assert not problems, "\n".join(problems)


def test_the_docs_are_read() -> None:
    names = {p.relative_to(REPO).as_posix() for p in markdown_files()}
    assert {"README.md", "deploy/README.md", "docs/tuning.md"} <= names
    assert not any(n.startswith((".venv/", ".runtime/")) for n in names)


# ---------------------------------------------------------------------------
# (b) Flags


@dataclass(frozen=True)
class Parsers:
    """csi-qsd's options and subcommands, by the subcommand path that reaches each parser."""

    options: dict[tuple[str, ...], frozenset[str]]
    commands: dict[tuple[str, ...], frozenset[str]]

    @classmethod
    def of(cls, parser: argparse.ArgumentParser) -> Parsers:
        options: dict[tuple[str, ...], frozenset[str]] = {}
        commands: dict[tuple[str, ...], frozenset[str]] = {}

        def walk(p: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
            options[path] = frozenset(o for a in p._actions for o in a.option_strings)
            subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
            commands[path] = frozenset(name for s in subs for name in s.choices)
            for sub in subs:
                for name, child in sub.choices.items():
                    walk(child, (*path, name))

        walk(parser, ())
        return cls(options, commands)

    def every_option(self) -> frozenset[str]:
        return frozenset().union(*self.options.values())

    def check(self, args: list[str], start: tuple[str, ...] = ()) -> Iterator[str]:
        """What is wrong with `csi-qsd ARGS`: unknown subcommands and flags."""
        path = start
        for arg in args:
            if arg.startswith("-") or not self.commands[path]:
                continue
            if arg in self.commands[path]:
                path = (*path, arg)
            elif re.fullmatch(r"[a-z][a-z-]*", arg):
                yield f"unknown subcommand {' '.join(('csi-qsd', *path, arg))}"
                return
        allowed = frozenset().union(*(self.options[path[:i]] for i in range(len(path) + 1)))
        for flag in flags_in(args):
            if flag not in allowed:
                yield f"{' '.join(('csi-qsd', *path))} has no flag {flag}"


def flags_in(args: list[str]) -> list[str]:
    return [m.group(1) for m in (re.fullmatch(r"(--?[A-Za-z][\w-]*)(=.*)?", a) for a in args) if m]


def bench_options(module: str) -> frozenset[str] | None:
    """The flags a bench module (or a bench module it imports) adds; None if there is no such module."""
    source = BENCH_DIR / f"{module}.py"
    if not source.is_file():
        return None
    text = source.read_text(encoding="utf-8")
    imported = re.findall(r"^from e2e\.bench(?:\.(\w+) import| import (\w+))", text, flags=re.MULTILINE)
    for name in {a or b for a, b in imported}:
        if (BENCH_DIR / f"{name}.py").is_file():
            text += (BENCH_DIR / f"{name}.py").read_text(encoding="utf-8")
    calls = re.findall(r"add_argument\(([^)]*)", text)
    return frozenset({"-h", "--help"}).union(*(re.findall(r"[\"'](-{1,2}[\w-]+)[\"']", c) for c in calls))


COMMAND_SPLIT = re.compile(r"\|\||&&|\$\(|[|;()`]")
PREFIXES = frozenset({"exec", "sudo", "env", "bash", "sh", "nohup", "time"})


@dataclass(frozen=True)
class Command:
    """One command line the docs give: csi-qsd's (with the subcommand path it starts at) or a bench's."""

    args: list[str]
    start: tuple[str, ...] = ()
    bench: str = ""


def commands_in(text: str) -> Iterator[Command]:
    """The csi-qsd and bench command lines in one logical shell line."""
    for segment in COMMAND_SPLIT.split(text):
        words = segment.split()
        while words and (words[0] in PREFIXES or re.match(r"[A-Za-z_]\w*=", words[0])):
            words.pop(0)
        if not words:
            continue
        if re.fullmatch(r"(\S*/bin/)?csi-qsd", words[0]):
            yield Command(words[1:])
        elif re.fullmatch(r"(\S*/)?scripts/run\.sh", words[0]):
            yield Command(words[1:], start=("serve",))
        elif (re.fullmatch(r"(\S*/)?python3?", words[0]) and len(words) > 2 and words[1] == "-m"
              and (bench := re.fullmatch(r"e2e\.bench\.(\w+)", words[2]))):
            yield Command(words[3:], bench=bench.group(1))


def shell_lines(code: list[str]) -> Iterator[str]:
    """A code block's logical lines: comments dropped, backslash continuations joined."""
    pending = ""
    for line in code:
        line = re.sub(r"(^|\s)#.*", "", line)
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield pending + line
        pending = ""
    if pending:
        yield pending


def flag_table_rows(page: Page) -> Iterator[tuple[list[str], list[str]]]:
    """(flags, variables) of each table row that pairs flags in its first column with CSI_QSD_* variables."""
    for line in page.prose:
        if not line.lstrip().startswith("|"):
            continue
        cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
        flags = [span.split()[0] for span in CODE_SPAN.findall(cells[0]) if span.startswith("--")]
        variables = [v for cell in cells[1:2] for v in re.findall(r"\bCSI_QSD_[A-Z0-9_]+", cell)]
        if flags and variables:
            yield flags, variables


@dataclass
class FlagCheck:
    parsers: Parsers
    problems: list[str] = field(default_factory=list)
    checked: int = 0

    def command(self, where: str, command: Command) -> None:
        args = command.args
        self.checked += len(flags_in(args))
        if command.bench:
            allowed = bench_options(command.bench)
            if allowed is None:
                self.problems.append(f"{where}: no bench module e2e.bench.{command.bench}")
                return
            self.problems += [f"{where}: e2e.bench.{command.bench} has no flag {f}"
                              for f in flags_in(args) if f not in allowed]
            return
        self.problems += [f"{where}: {p}" for p in self.parsers.check(args, command.start)]

    def page(self, page: Page, root: Path) -> None:
        name = page.path.relative_to(root)
        for line in shell_lines(page.code):
            for command in commands_in(line):
                self.command(f"{name}: {line.strip()}", command)
        prose = "\n".join(page.prose)
        by_line: dict[int, list[str]] = {}
        for span in CODE_SPAN.finditer(prose):
            by_line.setdefault(prose.count("\n", 0, span.start()), []).append(span.group(1).replace("\n", " "))
        every = self.parsers.every_option()
        for number, spans in sorted(by_line.items()):
            found = [c for s in spans if not s.startswith("--") for c in commands_in(s)]
            for command in found:
                self.command(f"{name}:{number + 1}", command)
            if any(not c.bench for c in found):
                # Flag spans beside a csi-qsd command line: any of its subcommands' flags.
                loose = flags_in([s.split()[0] for s in spans if s.startswith("--")])
                self.checked += len(loose)
                self.problems += [f"{name}:{number + 1}: csi-qsd has no flag {f}" for f in loose if f not in every]
        for flags, variables in flag_table_rows(page):
            self.checked += len(flags)
            self.problems += [f"{name}: table row {flag}: csi-qsd has no such flag" for flag in flags
                              if flag not in every]
            if variables != [cli.env_name(flag) for flag in flags]:
                self.problems.append(f"{name}: table row {', '.join(flags)} names {', '.join(variables)}")


def flag_problems(paths: list[Path], root: Path = REPO) -> tuple[list[str], int]:
    check = FlagCheck(Parsers.of(cli.build_parser()))
    for path in paths:
        check.page(Page.read(path), root)
    return check.problems, check.checked


def test_every_flag_named_exists() -> None:
    problems, checked = flag_problems(markdown_files())
    assert not problems, "\n".join(problems)
    assert checked > 40, "the docs' flags were not found"


# ---------------------------------------------------------------------------
# The checks themselves fail on what they are for.


def test_a_broken_link_or_anchor_is_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Flags: `csi-qsd serve`\n\n```\n# not a heading\n```\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md#flags-csi-qsd-serve) [top](docs/a.md#a-page) [here](#title)\n\n# Title\n"
        "[gone](docs/b.md) [no heading](docs/a.md#not-a-heading) `[in code](nowhere.md)`\n"
        "[wrapped\ntext](docs/a.md#missing)\n"
    )
    problems = link_problems(markdown_files(tmp_path), tmp_path)
    assert len(problems) == 3, problems
    assert "no file docs/b.md" in problems[0]
    assert "#not-a-heading" in problems[1] and "#missing" in problems[2]


def test_an_unknown_flag_is_found(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text(
        "```sh\n"
        ".venv/bin/csi-qsd volume create v --size 1Gi --no-such-flag   # comment --not-checked\n"
        "csi-qsd serve --state-dir /x \\\n    --remote-pool a=nbd://h/e --bogus\n"
        "fio --not-ours   # another tool\n"
        "VOL=$(csi-qsd volume list --endpoint unix:///x | python3 -c 'x --y')\n"
        "./scripts/run.sh --loop-io direct --nope\n"
        ".venv/bin/python -m e2e.bench.grow_by_move --gib 1 --wrong\n"
        "```\n\n```text\ncsi-qsd 0.1.0 listening on … (output)\n```\n\n```yaml\nargs: [csi-qsd, --yaml]\n```\n\n"
        "Run `csi-qsd volume backup S -o f --since T` or `csi-qsd volume nbd-export S --sockets P`;\n"
        "`csi-qsd serve` takes `--iothreads N` and `--fuse-thread pool`;\nfio's `--direct` is not ours,\n"
        "`csi-qsd volme list`, and `kubectl -n csi-qsd get pods -o wide` is not ours.\n\n"
        "| flag | environment |\n|---|---|\n| `--state-dir` | `CSI_QSD_STATE_DIR` |\n"
        "| `--metadata-cert`, `--metadata-kee` | `CSI_QSD_METADATA_CERT`, `CSI_QSD_METADATA_KEY` |\n"
        "| `--node-id` | `CSI_QSD_NODE_NAME` |\n"
    )
    problems, _ = flag_problems([tmp_path / "README.md"], tmp_path)
    text = "\n".join(problems)
    for wrong in ("--no-such-flag", "--bogus", "--nope", "--wrong", "--sockets", "--fuse-thread",
                  "unknown subcommand csi-qsd volme", "has no such flag", "CSI_QSD_NODE_NAME"):
        assert wrong in text, (wrong, text)
    for fine in ("--not-checked", "--not-ours", "--y", "--direct", "-o", "--endpoint", "--gib",
                 "--since", "--iothreads", "--loop-io", "--remote-pool", "--yaml"):
        assert f"flag {fine}\n" not in text + "\n", (fine, text)
    assert "kubectl" not in text and "listening" not in text
    assert len(problems) == 10, text
