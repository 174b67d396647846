"""Reading the docs for tests/docs: runnable blocks, the `slidefusion ...` commands written in them,
and the flags the CLI's parser knows.

Config keys are read the same way: every `section.key=VALUE` word after `slidefusion train` or
`slidefusion cache`, and every key of a ```yaml block whose top-level keys are config sections.

A runnable block is a fenced code block (```bash or ```python) whose fence line directly follows a
line that is exactly `<!-- runnable -->`. Commands are read from every fenced block and every
inline code span: a `slidefusion COMMAND ...` (or `-m slidefusion COMMAND ...`) with its
backslash-continued lines, up to a comment, a pipe or another shell command.
"""

import argparse
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- runnable -->"
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
INLINE = re.compile(r"`([^`\n]+)`")
SHELL_BREAKS = {"|", "||", "&&", ";", ">", "2>&1", ">>"}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT).as_posix()}:{self.line}"


def doc_files() -> list[Path]:
    """README.md and every Markdown page under docs/ (generated result tables included)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _fenced(path: Path):
    """(opening line number, language, code lines, marked runnable) for each fenced block."""
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, language, start = opening.group(1), opening.group(2), i
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        marked = start > 0 and lines[start - 1].strip() == MARKER
        yield start + 1, language, body, marked
        i += 1


def runnable_blocks(paths) -> list[Block]:
    blocks = []
    for path in paths:
        for line, language, body, marked in _fenced(path):
            if marked:
                assert language in ("bash", "python"), f"{path}:{line}: a runnable block must be bash or python"
                blocks.append(Block(path, line, language, "\n".join(body) + "\n"))
    return blocks


def _joined(lines: list[str]) -> list[str]:
    """Shell lines with backslash continuations joined."""
    out, current = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
        else:
            out.append(current + line)
            current = ""
    if current:
        out.append(current)
    return out


def command_lines(path: Path) -> list[tuple[str, str]]:
    """(where, text) for every line or inline span that mentions slidefusion followed by more."""
    found = []
    where = path.relative_to(ROOT).as_posix()
    for line, language, body, _ in _fenced(path):
        if language in ("bash", "", "text", "sh", "console"):
            found += [(f"{where}:{line}", text) for text in _joined(body) if "slidefusion " in text]
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # inline spans outside fenced blocks only
    found += [(where, span) for span in INLINE.findall(text) if "slidefusion " in span]
    return found


def _tokens(text: str) -> list[str]:
    try:
        return shlex.split(text, comments=True)
    except ValueError:  # an unbalanced quote in prose: fall back to plain words
        return text.split()


def flags_of(text: str) -> tuple[str | None, list[str]]:
    """The command and the long flags of the first `slidefusion COMMAND ...` in `text`; (None, [])
    when there is none or the command is a placeholder (COMMAND, ...)."""
    tokens = _tokens(text)
    for i, token in enumerate(tokens):
        if token.rsplit("/", 1)[-1] == "slidefusion" and i + 1 < len(tokens):
            rest = tokens[i + 1:]
            break
    else:
        return None, []
    if rest[0].startswith("-"):
        command, args = "", rest
    elif rest[0].isupper() or not re.fullmatch(r"[a-z][a-z-]*", rest[0]):
        return None, []
    else:
        command, args = rest[0], rest[1:]
        if args and command == "experiment" and re.fullmatch(r"[a-z][a-z-]*", args[0]):
            command, args = f"experiment {args[0]}", args[1:]
    flags = []
    for arg in args:
        if arg in SHELL_BREAKS:
            break
        if arg.startswith("--"):
            flags.append(arg.split("=", 1)[0])
    return command, flags


def _long_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings if s.startswith("--")}


def subparsers() -> dict[str, set[str]]:
    """Every command path ("" for the root, "train", "experiment attention-ablation") and its long
    flags, read from the parser that the public `slidefusion.cli` entry builds, whether cli is a
    module or a package."""
    import slidefusion.cli as cli

    build = getattr(cli, "parser", None) or getattr(cli, "build_parser")
    found: dict[str, set[str]] = {}

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        found[path] = _long_flags(parser)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    walk(child, f"{path} {name}".strip())

    walk(build(), "")
    return found


def config_words(text: str) -> list[str]:
    """The dotted keys of the `section.key=VALUE` words of the first `slidefusion train|cache ...`
    in `text` (the part before '=')."""
    tokens = _tokens(text)
    for i, token in enumerate(tokens):
        if token.rsplit("/", 1)[-1] == "slidefusion" and i + 1 < len(tokens) and tokens[i + 1] in ("train", "cache"):
            break
    else:
        return []
    keys = []
    for arg in tokens[i + 2:]:
        if arg in SHELL_BREAKS:
            break
        found = re.fullmatch(r"([A-Za-z_]\w*(?:\.\w+)+)=.*", arg, flags=re.S)
        if found:
            keys.append(found.group(1))
    return keys


def yaml_blocks(path: Path) -> list[tuple[str, str]]:
    """(where, text) of every ```yaml block."""
    where = path.relative_to(ROOT).as_posix()
    return [(f"{where}:{line}", "\n".join(body)) for line, language, body, _ in _fenced(path) if language == "yaml"]


def train_config_keys() -> dict[str, set[str] | None]:
    """Each config section's keys (None for a top-level key that is not a section), read from the
    config classes; `model` has the keys of both of its forms (our models, a diffusers folder)."""
    import dataclasses
    import typing

    from slidefusion.io.config import config_keys
    from slidefusion.training.config import TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    sections: dict[str, set[str] | None] = {}
    for name in config_keys(TrainConfig):
        classes = [t for t in typing.get_args(hints[name]) or (hints[name],) if dataclasses.is_dataclass(t)]
        sections[name] = {key for cls in classes for key in config_keys(cls)} if classes else None
    return sections


def unknown_config_key(key: str, sections: dict[str, set[str] | None]) -> str | None:
    """Why the dotted `key` names no config key (None when it does). `train.parallel.KEY` is the alias
    of `parallel.KEY`; deeper parts (model.attention_options.grid) are the value's own."""
    parts = key.split(".")
    if parts[:2] == ["train", "parallel"]:
        parts = parts[1:]
    if parts[0] not in sections:
        return f"no config section {parts[0]!r}"
    keys = sections[parts[0]]
    if keys is None:
        return f"{parts[0]} is a plain key, not a section"
    if len(parts) > 1 and parts[1] not in keys:
        return f"section {parts[0]} has no key {parts[1]!r}"
    return None
