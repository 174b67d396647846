"""What a newcomer sees first: --version, a bare `slidefusion`, every --help (a help text on every
flag, examples at the end, train's config keys), and the hints for a config key written as a flag
and for a missing optional package."""

import argparse
import dataclasses
import shlex
import typing

import pytest

import slidefusion
from slidefusion import cli


def _commands(parser, path=""):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _commands(child, f"{path} {name}".strip())


COMMANDS = dict(_commands(cli.parser()))
LEAVES = [path for path, parser in COMMANDS.items()
          if path and not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)]


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"slidefusion {slidefusion.__version__}"


def test_bare_command_prints_help_and_succeeds(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: slidefusion") and all(name in out for name in ("train", "generate", "plan", "demo"))


def test_every_flag_and_command_has_help():
    missing = [f"{path or 'slidefusion'} {action.option_strings or action.dest}"
               for path, parser in COMMANDS.items() for action in parser._actions if not action.help]
    missing += [f"{path} {choice.dest}" for path, parser in COMMANDS.items() for action in parser._actions
                if isinstance(action, argparse._SubParsersAction) for choice in action._choices_actions if not choice.help]
    assert not missing, missing


@pytest.mark.parametrize("path", LEAVES)
def test_every_command_help_ends_with_examples_that_parse(path, capsys):
    with pytest.raises(SystemExit) as done:
        cli.parser().parse_args([*path.split(), "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    examples = text.rsplit("examples:\n", 1)[1].strip().splitlines()
    assert "examples:\n" in text and 2 <= len(examples) <= 3, text
    flags = {s for a in COMMANDS[path]._actions for s in a.option_strings}
    for line in examples:
        words = shlex.split(line)
        words = words[words.index("slidefusion") + 1:]
        assert " ".join(words).startswith(path), line
        for word in words:
            assert not word.startswith("--") or word.split("=")[0] in flags, (line, word)


def test_train_help_lists_every_config_key_with_its_default(capsys):
    """Every key a config file may set (fields the program sets, such as offload.optim, are not listed)."""
    from slidefusion.data.config import SourceConfig
    from slidefusion.io.config import config_keys
    from slidefusion.training.config import TrainConfig

    with pytest.raises(SystemExit):
        cli.parser().parse_args(["train", "--help"])
    text = capsys.readouterr().out
    for name in config_keys(TrainConfig):
        hint = typing.get_type_hints(TrainConfig)[name]
        sections = [t for t in typing.get_args(hint) or (hint,) if dataclasses.is_dataclass(t)]
        if not sections:
            assert f"    {name}: " in text, name
        for section in sections:
            assert f"  {name}" in text, name
            for key in config_keys(section):
                assert f"    {key}: " in text, f"{name}.{key}"
    for key in config_keys(SourceConfig):  # the keys of one data.datasets entry
        assert f"        {key}: " in text, f"data.datasets[].{key}"
    assert "    optim: " not in text.split("  offload:")[1].split("  validate:")[0]  # set by the program
    assert "    lr: float = 0.0003" in text and "    rank: int | null = null" in text


@pytest.mark.parametrize("written, hint", [(["--lora.rank", "4"], "write lora.rank=4"),
                                           (["--run.steps=7"], "write run.steps=7"),
                                           (["--optim.lr"], "write optim.lr=VALUE")])
def test_a_config_key_written_as_a_flag_gets_the_hint(written, hint, capsys):
    assert cli.main(["train", "configs/tiny.yaml", *written]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("slidefusion train: error: unrecognized arguments") and hint in err[0], err


def test_an_unrelated_unknown_flag_gets_no_config_hint(capsys):
    assert cli.main(["train", "configs/tiny.yaml", "--fast"]) == 2
    assert "write" not in capsys.readouterr().err


def test_a_missing_optional_package_names_its_extra(monkeypatch, capsys):
    import slidefusion.demo

    def missing(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'cv2'", name="cv2")

    monkeypatch.setattr(slidefusion.demo, "run_demo", missing)
    assert cli.main(["demo", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["slidefusion demo: error: this needs the 'eval' extra (module 'cv2' is missing): "
                   "pip install 'slidefusion[eval]'"], err


def test_any_other_missing_module_is_a_bug_and_stays_a_traceback(monkeypatch):
    import slidefusion.demo

    def missing(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'slidefusion.gone'", name="slidefusion.gone")

    monkeypatch.setattr(slidefusion.demo, "run_demo", missing)
    with pytest.raises(ModuleNotFoundError):
        cli.main(["demo", "--quiet"])


def test_the_cli_works_without_the_optional_packages_and_names_the_extra(tmp_path):
    """As installed without extras: cv2, matplotlib, diffusers and triton unimportable. Every command
    still parses, `plan` runs, and `evaluate` (which needs cv2) says which extra to install."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = ("import sys\n"
              "for name in ('cv2', 'matplotlib', 'diffusers', 'peft', 'accelerate', 'triton'):\n"
              "    sys.modules[name] = None  # import fails with ModuleNotFoundError, as when not installed\n"
              "from slidefusion.cli import main\n"
              "sys.exit(main(sys.argv[1:]))\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), HF_HUB_OFFLINE="1")

    def run(*argv):
        return subprocess.run([sys.executable, "-c", script, *argv], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)

    plan = run("plan", "--model", "dit3d-tiny", "--frames", "8", "--height", "32", "--width", "32")
    assert plan.returncode == 0 and "verdict: fits" in plan.stdout, plan.stderr
    evaluate = run("evaluate", "--ground-truth", "--num", "1", "--quiet")
    assert evaluate.returncode == 2, evaluate.stderr
    assert evaluate.stderr.strip().splitlines() == [("slidefusion evaluate: error: this needs the 'eval' extra "
                                                         "(module 'cv2' is missing): pip install 'slidefusion[eval]'")]
