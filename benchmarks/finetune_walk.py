"""The fine-tune walk: which slidefusion modules `slidefusion train configs/wan-finetune.yaml
model.pretrained=DIR --offload lora.rank=16` passes through, from the command to the first step.

Prints the tree of cross-module calls (a call whose nearest slidefusion caller is in another module;
imports, class bodies and the error/validation helpers left out; each function once), to --depth
levels, on a tiny random Wan pipeline folder written to a temporary folder. Not a timing benchmark.

    python benchmarks/finetune_walk.py --depth 6
"""

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SKIP = ("slidefusion.errors", "slidefusion.validate", "slidefusion.core", "slidefusion.testing", "slidefusion.cli.args")


def walk(depth_limit: int) -> list[tuple[int, str]]:
    from slidefusion.cli import main
    from slidefusion.testing.tiny import save_tiny_wan_pipeline

    tmp = Path(tempfile.mkdtemp())
    folder = save_tiny_wan_pipeline(tmp / "wan")
    argv = ["train", "configs/wan-finetune.yaml", f"model.pretrained={folder}", "--offload", "lora.rank=16",
            "data.kind=shapes", "data.num_samples=2", "data.frames=5", "data.height=48", "data.width=80",
            "run.device=cpu", "run.steps=1", "run.batch_size=1", f"run.output_dir={tmp}/runs", "--quiet"]
    lines, seen, depth, done = [], set(), {}, [False]

    def name(frame) -> str:
        return frame.f_globals.get("__name__", "")

    def profile(frame, event, arg):
        code = frame.f_code
        if done[0] or event != "call" or not code.co_flags & 0x02:  # 0x02: a function (not a class body)
            return
        module = name(frame)
        if code.co_name == "train_step" and module.startswith("slidefusion"):
            done[0] = True
            return
        caller = frame.f_back
        while caller is not None and id(caller) not in depth:
            caller = caller.f_back
        if not module.startswith("slidefusion") or module.startswith(SKIP) or "<" in code.co_qualname:
            return
        level = (depth[id(caller)] if caller is not None else 0) + (name(caller) != module if caller else 1)
        depth[id(frame)] = level
        key = (module, code.co_qualname)
        if (caller is None or name(caller) != module) and level <= depth_limit and key not in seen:
            seen.add(key)
            lines.append((level, f"{module.removeprefix('slidefusion.')}.{code.co_qualname}"))

    sys.setprofile(profile)
    try:
        main(argv)
    finally:
        sys.setprofile(None)
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=5, help="levels of cross-module calls to print (default 5)")
    for level, text in walk(parser.parse_args().depth):
        print("  " * level + text)
