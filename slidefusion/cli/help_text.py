"""What `--help` shows beyond the flags: the version, each command's examples, and `train`'s config keys.

Each command module registers its examples with `examples(parser, lines)`; `finish(root)` is called
once on the finished parser and adds `--version` and a help text for the subcommand choice.
`config_keys()` lists every section and key a `train` config takes, with its type and default, read
from the config dataclasses so that the listing never goes stale; `missing_extra` names the pip extra
that brings an optional module which is not installed.
"""

import argparse
import dataclasses
import types
import typing

# The optional modules, and the extra of pyproject.toml that installs each.
EXTRAS = {"diffusers": "diffusers", "accelerate": "diffusers", "peft": "diffusers", "triton": "triton",
          "cv2": "eval", "matplotlib": "eval", "tensorboard": "tensorboard", "wandb": "wandb", "mkdocs": "docs"}


def finish(root: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`--version` on the root, and a help text on every subcommand choice that lacks one."""
    from slidefusion import __version__

    root.add_argument("--version", action="version", version=f"slidefusion {__version__}",
                      help="print the version and exit")
    for parser in _parsers(root):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction) and action.help is None:
                action.help = "the command; add --help after it for its flags"
    return root


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _parsers(child)


def examples(parser: argparse.ArgumentParser, lines: list[str], before=None) -> None:
    """End `parser`'s help with `lines` as examples; `before()`, called only when the help is shown,
    gives text to put ahead of them (train's config keys, which need the config classes imported)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    text = "examples:\n" + "\n".join(f"  {line}" for line in lines)
    parser.epilog = f"{parser.epilog}\n\n{text}" if parser.epilog else text
    if before is not None:
        parser.epilog_before = before  # read by ArgumentParser.format_help


def config_keys() -> str:
    """Every config section and key of `slidefusion train`, with its type and default."""
    from slidefusion.io.config import config_keys as keys_of
    from slidefusion.pretrained.config import PretrainedModelConfig
    from slidefusion.training.config import TrainConfig

    lines = ["config keys (override any as section.key=VALUE, a YAML value; the YAML file's values come first):"]
    top = []
    hints = typing.get_type_hints(TrainConfig)
    for name in keys_of(TrainConfig):
        sections = [t for t in typing.get_args(hints[name]) or (hints[name],) if dataclasses.is_dataclass(t)]
        if not sections:
            top.append(_key_line(name, TrainConfig, hints[name]))
            continue
        for section in sections:
            title = name
            if section is PretrainedModelConfig:
                title += " (with model.pretrained=DIR, a diffusers folder)"
            elif name == "model":
                title += " (our models; model.preset=NAME fills these first, e.g. dit3d-tiny)"
            lines += [f"  {title}:", *_section_lines(section, "    ")]
    return "\n".join(lines + ["  (top level):", *[f"    {line}" for line in top]])


def _section_lines(section, indent: str) -> list[str]:
    """One line per key of `section`; a list of entries (data.datasets) lists an entry's keys below it."""
    from slidefusion.io.config import config_keys as keys_of

    hints, lines = typing.get_type_hints(section), []
    for name in keys_of(section):
        lines.append(indent + _key_line(name, section, hints[name]))
        entry = _entry_class(hints[name])
        if entry is not None:
            lines += [f"{indent}  each entry:", *_section_lines(entry, indent + "    ")]
    return lines


def _entry_class(hint):
    """The dataclass of a `list[SomeConfig] | None` hint, else None."""
    for arg in typing.get_args(hint) or (hint,):
        if typing.get_origin(arg) is list and dataclasses.is_dataclass(typing.get_args(arg)[0]):
            return typing.get_args(arg)[0]
    return None


def _key_line(name: str, cls, hint) -> str:
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    if field.default is not dataclasses.MISSING:
        default = field.default
    elif field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    else:
        default = "(required)"
    if dataclasses.is_dataclass(default):
        default = "{...}"
    default = "null" if default is None else str(default).lower() if isinstance(default, bool) else default
    return f"{name}: {_type_name(hint)} = {default}"


def _type_name(hint) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(hint))
    if typing.get_args(hint):
        return f"{typing.get_origin(hint).__name__}[{', '.join(_type_name(a) for a in typing.get_args(hint))}]"
    return getattr(hint, "__name__", str(hint))


def missing_extra(error: ModuleNotFoundError) -> str | None:
    """The one-line message for an optional module that is not installed, or None if `error` is
    about anything else."""
    module = (error.name or "").split(".")[0]
    if module not in EXTRAS:
        return None
    extra = EXTRAS[module]
    return f"this needs the '{extra}' extra (module '{module}' is missing): pip install 'slidefusion[{extra}]'"
