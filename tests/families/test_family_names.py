"""Every family fact lives in `slidefusion/families/`: no family name and no class name a family record
names (its diffusers transformer, pipelines, schedulers, attention processors and modules, VAEs, text
encoders) appears as a string literal anywhere else in the package.

Docstrings and comments may mention families (they explain); code may not branch on them. Excluded:
`slidefusion/families/` itself, `slidefusion/testing/` (it builds tiny models of each family for the
tests), the tests and the benchmarks (scripts that pick concrete models to run).
"""

import ast
import re
from pathlib import Path

from slidefusion.families import ADAPTERS, FAMILIES

PACKAGE = Path(__file__).resolve().parents[2] / "slidefusion"
EXCLUDED = ("families", "testing")
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _class_names() -> set[str]:
    """Every foreign class name the family records name."""
    names = set()
    for adapter in ADAPTERS.values():
        if adapter.text is None:  # our own DiT3D / STDiT: slidefusion's classes, defined in models/
            continue
        names |= {adapter.class_name, *adapter.pipelines, adapter.objective.scheduler, *adapter.text.encoder_classes}
        names |= set(adapter.swap.processors if adapter.swap else ())
        names |= set(adapter.token_tiling.processors if adapter.token_tiling else ())
        names |= {key.rsplit(".", 1)[-1] for key in adapter.attention if isinstance(key, str)}
        names |= {*adapter.vae.image, *adapter.vae.splits}
    return names


def _literals(path: Path):
    """(line, text) of every string constant in `path` that is not a docstring."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def test_the_forbidden_names_are_the_records_own():
    names = _class_names()
    assert {"WanTransformer3DModel", "WanAttnProcessor", "CogVideoXPipeline", "AttnProcessor2_0", "AutoencoderKLWan",
            "FlowMatchEulerDiscreteScheduler", "WanAttention"} <= names
    assert set(FAMILIES) == {"ours", "wan", "cogvideox", "hunyuanvideo", "ltx", "mochi", "latte"}


def test_no_family_or_family_class_is_named_outside_families():
    names, found = _class_names(), []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] in EXCLUDED:
            continue
        for line, text in _literals(path):
            hits = sorted({w for w in WORD.findall(text) if w in names} | ({text} & set(FAMILIES)))
            found += [f"{path.relative_to(PACKAGE.parent)}:{line}: {hit}" for hit in hits]
    assert not found, "family facts outside slidefusion/families/:\n" + "\n".join(found)
