"""The documentation is tested like code.

- Every fenced block marked runnable (a line `<!-- runnable -->` right before the fence) in
  README.md and docs/ runs as written, in a fresh temporary folder beside a link to configs/:
  bash blocks under `bash -euo pipefail`, python blocks under this interpreter.
- Every `slidefusion COMMAND --flag` written anywhere in README.md and docs/ (code blocks and
  inline code) names a command and flags that the CLI's parser has.
- Every `section.key=VALUE` after `slidefusion train|cache`, and every key of a YAML block of config
  sections, names a config key; no example imports a module kept only for old code.
- The site builds with `mkdocs build --strict` (broken links, anchors and nav entries fail it).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import yaml
from docs_snippets import (
    ROOT,
    command_lines,
    config_words,
    doc_files,
    flags_of,
    runnable_blocks,
    subparsers,
    train_config_keys,
    unknown_config_key,
    yaml_blocks,
)

BLOCKS = runnable_blocks(doc_files())
TIMEOUT_S = 600


def _env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # this venv's slidefusion, torchrun
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(ROOT)
    env.setdefault("OMP_NUM_THREADS", "2")
    return env


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_runnable_block(block, tmp_path):
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    command = ["bash", "-euo", "pipefail", "-c", block.code] if block.language == "bash" else [sys.executable, "-c", block.code]
    done = subprocess.run(command, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"{block.id} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def test_the_docs_have_runnable_blocks():
    """Guards the marker: a renamed marker would silently turn every runnable test off."""
    languages = {b.language for b in BLOCKS}
    assert len(BLOCKS) >= 5 and languages == {"bash", "python"}, [b.id for b in BLOCKS]


def test_every_documented_flag_exists():
    commands = subparsers()
    lines = [line for path in doc_files() for line in command_lines(path)]
    assert len(lines) > 30, "too few slidefusion commands found: is the scan broken?"
    unknown = []
    for where, text in lines:
        command, flags = flags_of(text)
        if command is None:
            continue
        if command not in commands:
            unknown.append(f"{where}: unknown command {command!r} in {text!r}")
            continue
        known = commands[command]
        unknown += [f"{where}: {command} has no {flag} (in {text!r})" for flag in flags if flag not in known]
    assert not unknown, "\n".join(unknown)


def test_every_documented_config_key_exists():
    sections = train_config_keys()
    found, unknown = 0, []
    for path in doc_files():
        for where, text in command_lines(path):
            for key in config_words(text):
                found += 1
                why = unknown_config_key(key, sections)
                if why:
                    unknown.append(f"{where}: {key}: {why} (in {text!r})")
        for where, text in yaml_blocks(path):
            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError:
                continue
            if not isinstance(data, dict) or not data or not set(data) <= set(sections):
                continue  # not a training config's sections
            for section, body in data.items():
                for key in body if isinstance(body, dict) else ():
                    found += 1
                    why = unknown_config_key(f"{section}.{key}", sections)
                    if why:
                        unknown.append(f"{where}: {section}.{key}: {why}")
    assert found > 30, "too few config keys found: is the scan broken?"
    assert not unknown, "\n".join(unknown)


# Modules kept only so that old imports keep working for a while; examples must use their successors.
OLD_MODULES = ("slidefusion.adapters", "slidefusion.processors", "slidefusion.errors", "slidefusion.validate",
               "slidefusion.cli_args", "slidefusion.parallel.api", "slidefusion.offload.config")


def test_no_example_imports_an_old_module():
    used = [f"{path.relative_to(ROOT)}: {name}" for path in doc_files() for name in OLD_MODULES
            if re.search(rf"\b{re.escape(name)}\b", path.read_text(encoding="utf-8"))]
    assert not used, used


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra (pip install '.[docs]') builds the site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").is_file()
