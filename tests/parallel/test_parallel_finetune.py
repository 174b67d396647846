"""`generate --checkpoint RUN --parallel` under torchrun for fine-tunes of a diffusers folder (every
weight, or LoRA's adapters): the run samples as its folder does, and the 2-rank latents equal the
one-process ones."""

import os
import subprocess
import sys

from safetensors.torch import load_file

from slidefusion.cli import main
from slidefusion.parallel.launch import free_port

SIZES = ["--frames", "5", "--height", "48", "--width", "80"]
PROMPT = ["--prompt", "a red circle moving left", "--steps", "2", "--guidance", "4", "--seed", "3", "--quiet"]


def _train(folder, out, name, *extra):
    args = ["train", "configs/wan-finetune.yaml", f"model.pretrained={folder}", "data.kind=shapes", "data.num_samples=1",
            "data.frames=5", "data.height=48", "data.width=80", "run.device=cpu", "run.steps=1", "run.batch_size=1",
            f"run.output_dir={out}", f"run.name={name}", "optim.lr=1e-2", "optim.warmup_steps=0", "--quiet", *extra]
    assert main(args) == 0
    return out / name


def test_torchrun_generate_of_full_and_lora_fine_tunes_equals_one_process(tiny_wan_dir, tmp_path):
    runs = {"full": _train(tiny_wan_dir, tmp_path, "full"), "lora": _train(tiny_wan_dir, tmp_path, "lora", "lora.rank=4")}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launched = {}
    for name, run in runs.items():  # both groups at once: their start-up (imports) dominates
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
               "-m", "slidefusion", "generate", "--checkpoint", str(run), *PROMPT, *SIZES, "--parallel", "ulysses",
               "--timeout", "150", "--out", str(tmp_path / f"{name}-p.gif"),
               "--save-latents", str(tmp_path / f"{name}-p.safetensors")]
        launched[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    for name, run in runs.items():
        assert main(["generate", "--checkpoint", str(run), *PROMPT, *SIZES, "--out", str(tmp_path / f"{name}-s.gif"),
                     "--save-latents", str(tmp_path / f"{name}-s.safetensors")]) == 0
    for name, proc in launched.items():
        try:
            _, err = proc.communicate(timeout=300)
        finally:
            proc.kill()  # only if still running: our own child, by handle
        assert proc.returncode == 0, (name, "\n".join(l for l in err.splitlines() if "rror" in l)[-2000:])
        single, parallel = (load_file(tmp_path / f"{name}-{k}.safetensors")["latents"] for k in "sp")
        assert single.shape == parallel.shape and (single - parallel).abs().max() <= 1e-5 * single.abs().max(), name
        assert (tmp_path / f"{name}-p.gif").is_file()
    full, lora = (load_file(tmp_path / f"{n}-s.safetensors")["latents"] for n in runs)
    assert (full - lora).abs().max() > 1e-4  # two different fine-tunes sampled, not the base twice
