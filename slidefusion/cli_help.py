"""What `--help` shows beyond the flags, and the hints around a mistaken command line.

`finish(root)` is called once on the finished parser: every command's help ends with examples,
`train --help` also lists the config sections and keys (types and defaults read from the config
dataclasses, so it never goes stale), and flags defined without a help text get one here.
`config_flag_hint` turns `--lora.rank 4` into the hint to write `lora.rank=4`, and
`missing_extra` names the pip extra that brings a missing optional module.
"""

import argparse
import dataclasses
import re
import types
import typing

EXAMPLES = {
    "train": ["slidefusion train configs/tiny.yaml run.steps=20 run.name=first",
              "slidefusion train configs/wan-finetune.yaml model.pretrained=Wan2.1-T2V-1.3B-Diffusers data.root=my-videos "
              "--offload",
              "slidefusion train configs/shapes-small.yaml --resume latest"],
    "generate": ["slidefusion generate --checkpoint runs/first --prompt \"a red circle moving right\" --out video.mp4",
                 "slidefusion generate --pretrained Wan2.1-T2V-1.3B-Diffusers --prompt \"a cat\" --frames 33 --height 480 "
                 "--width 832 --out cat.mp4",
                 "torchrun --nproc-per-node 2 -m slidefusion generate --init random --model stdit-tiny --prompt \"a red "
                 "circle\" --parallel scalefusion --out video.mp4"],
    "export": ["slidefusion export --checkpoint runs/first --out my-model",
               "slidefusion export --checkpoint runs/wan-finetune --out wan-tuned --format diffusers"],
    "demo": ["slidefusion demo",
             "slidefusion demo --prompt \"a blue square moving up slowly on a gray background\" --out outputs/square.mp4"],
    "simulate": ["slidefusion simulate",
                 "slidefusion simulate --scenario full --inter-gbps 3200 --json sim.json"],
    "plan": ["slidefusion plan --model wan2.1-14b --frames 81 --height 480 --width 832 --gpu-memory 24GB "
             "--host-memory 128GB --tflops 165 --pcie 25GB/s --master bf16 --moments int8 --resident-blocks auto",
             "slidefusion plan --model dit3d-105b --frames 256 --height 1080 --width 1920 --attention slide --disk 8TB"],
    "evaluate": ["slidefusion evaluate --checkpoint bundled --num 24 --json eval.json",
                 "slidefusion evaluate --ground-truth --num 24 --frames 32"],
    "experiment": ["slidefusion experiment attention-ablation --budget quick"],
    "experiment attention-ablation": ["slidefusion experiment attention-ablation --budget quick --out /tmp/ablation",
                                      "slidefusion experiment attention-ablation --budget full --variants dense slide"],
}

# Flags registered without a help text, keyed by (command, option).
HELP = {
    ("generate", "--prompt"): "the text to turn into a video",
    ("demo", "--prompt"): "the text to turn into a video (default: a red circle moving right quickly on a black background)",
    ("demo", "--frames"): "frames (default: the bundled model's 8)",
    ("demo", "--height"): "height in pixels (default: the bundled model's 32)",
    ("demo", "--width"): "width in pixels (default: the bundled model's 32)",
    ("demo", "--steps"): "Euler sampling steps (default 30)",
    ("simulate", "--gpus-per-node"): "GPUs in each node (default 8)",
    ("plan", "--batch"): "clips per step (default 1)",
    ("evaluate", "--device"): "cpu, cuda or cuda:N (default cpu)",
    ("evaluate", "--quiet"): "no progress bars",
}

EXTRAS = {"diffusers": "diffusers", "accelerate": "diffusers", "peft": "diffusers", "triton": "triton",
          "cv2": "eval", "matplotlib": "eval", "tensorboard": "tensorboard", "mkdocs": "docs"}


def finish(root: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`--version`, and examples, the train config listing and missing help texts on every command of `root`."""
    from slidefusion import __version__

    root.add_argument("--version", action="version", version=f"slidefusion {__version__}",
                      help="print the version and exit")
    for path, parser in _commands(root):
        for action in parser._actions:
            key = (path, action.option_strings[0] if action.option_strings else action.dest)
            if key in HELP:
                action.help = HELP[key]
            if isinstance(action, argparse._SubParsersAction) and action.help is None:
                action.help = "the command; add --help after it for its flags"
        if path not in EXAMPLES:
            continue
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
        text = "examples:\n" + "\n".join(f"  {line}" for line in EXAMPLES[path])
        if path == "train":
            text = config_keys() + "\n\n" + text
        parser.epilog = f"{parser.epilog}\n\n{text}" if parser.epilog else text
    return root


def _commands(parser: argparse.ArgumentParser, path: str = ""):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _commands(child, f"{path} {name}".strip())


def config_keys() -> str:
    """Every config section and key of `slidefusion train`, with its type and default."""
    from slidefusion.training.config import TrainConfig
    from slidefusion.training.finetune.config import PretrainedModelConfig

    lines = ["config keys (override any as section.key=VALUE, a YAML value; the YAML file's values come first):"]
    top = []
    for field in dataclasses.fields(TrainConfig):
        hint = typing.get_type_hints(TrainConfig)[field.name]
        sections = [t for t in typing.get_args(hint) or (hint,) if dataclasses.is_dataclass(t)]
        if not sections:
            top.append(_key_line(field, hint))
            continue
        for section in sections:
            title = field.name
            if section is PretrainedModelConfig:
                title += " (with model.pretrained=DIR, a diffusers folder)"
            elif field.name == "model":
                title += " (our models; model.preset=NAME fills these first, e.g. dit3d-tiny)"
            lines.append(f"  {title}:")
            hints = typing.get_type_hints(section)
            lines += [f"  {_key_line(f, hints[f.name])}" for f in dataclasses.fields(section)]
    return "\n".join(lines + ["  (top level):", *[f"  {line}" for line in top]])


def _key_line(field: dataclasses.Field, hint) -> str:
    if field.default is not dataclasses.MISSING:
        default = field.default
    elif field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    else:
        default = "(required)"
    default = "null" if default is None else str(default).lower() if isinstance(default, bool) else default
    return f"  {field.name}: {_type_name(hint)} = {default}"


def _type_name(hint) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(hint))
    if typing.get_args(hint):
        return f"{typing.get_origin(hint).__name__}[{', '.join(_type_name(a) for a in typing.get_args(hint))}]"
    return getattr(hint, "__name__", str(hint))


def config_flag_hint(extras: list[str]) -> str:
    """'; write lora.rank=4 ...' when an unrecognised argument looks like a config key written as a
    flag (`--lora.rank 4` or `--lora.rank=4`), else ''."""
    for i, arg in enumerate(extras):
        found = re.fullmatch(r"--([A-Za-z_]\w*(?:\.\w+)+)(?:=(.*))?", arg)
        if found:
            value = found.group(2)
            if value is None:
                following = extras[i + 1] if i + 1 < len(extras) else ""
                value = following if following and not following.startswith("--") else "VALUE"
            return f"; write {found.group(1)}={value} (config keys are section.key=VALUE words, not flags)"
    return ""


def missing_extra(error: ModuleNotFoundError) -> str | None:
    """The one-line message for an optional module that is not installed, or None if `error` is
    about anything else."""
    module = (error.name or "").split(".")[0]
    if module not in EXTRAS:
        return None
    extra = EXTRAS[module]
    return f"this needs the '{extra}' extra (module '{module}' is missing): pip install 'slidefusion[{extra}]'"
