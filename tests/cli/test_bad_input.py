"""Malformed invocations of every subcommand: each must exit 2 with exactly one stderr line that
names the parameter, print no traceback, and create or change no file (the run lock's pid aside).

Everything runs in-process through `slidefusion.cli.main`, in a fresh working folder.

To cover a new flag, add a row to FLAGS (a flag whose values have a kind below) or to CASES (an
invocation and the text its error line must contain). Placeholders in `{braces}` name the
fixtures built once in `world` (runs, damaged checkpoints, files of the wrong kind).
"""

import json
import os
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from slidefusion.cli import main

REPO = Path(__file__).resolve().parents[2]
NO_CUDA = not torch.cuda.is_available()

# Values that are wrong for every flag of a kind.
BAD = {
    "positive_int": ["0", "-1", "abc", "1.5", "", "1e3", "9" * 30],
    "natural_int": ["-1", "abc", "0.5", ""],
    "positive_float": ["0", "-1", "nan", "inf", "-inf", "1e400", "abc", ""],
    "guidance": ["nan", "inf", "-1", "1e400", "101", "abc", ""],
    "steps": ["0", "-1", "10001", "abc"],
    "seed": ["-1", str(2**64), "abc", "1.5", ""],
    "device": ["cuda:99", "tpu", "meta", "", "gpu"] + (["cuda"] if NO_CUDA else []),
    "size": ["0", "0GB", "-1GB", "1e400GB", "lots", "nanGB", "inf", ""],
    "bandwidth": ["0", "0GB/s", "-5GB/s", "1e400GB/s", "fast", ""],
    "video_out": ["{cwd}/v.avi", "", "{folder}", "/proc/nope/v.gif", "{file}/v.gif"],
    "json_out": ["{cwd}/x.txt", "", "{folder_json}", "/proc/nope/x.json", "{file}/x.json"],
    "text": ["", "   "],
    "folder_in": ["{cwd}/nowhere", "{file}"],
}

# A valid invocation per command; a FLAGS row appends `--flag=BAD` to it (argparse: the last wins).
BASE = {
    "generate": "generate --init random --model stdit-tiny --prompt x --steps 1 --frames 1 --height 4 --width 4 "
                "--out {cwd}/v.gif --quiet",
    "demo": "demo --steps 1 --frames 1 --height 32 --width 32 --out {cwd}/demo.mp4 --quiet",
    "plan": "plan --model dit3d-tiny --frames 8 --height 32 --width 32 --attention dense",
    "simulate": "simulate --scenario custom --nodes 1",
    "evaluate": "evaluate --ground-truth --num 1 --frames 4 --quiet",
    "train": "train {tiny} run.steps=1 run.output_dir={cwd}/runs --quiet",
    "export": "export --checkpoint {ckpt} --out {cwd}/exported",
}
# A valid fine-tune of the tiny Wan folder (`{ft} key=BAD`) and a valid sampling of it (`{genp} --flag BAD`).
FINETUNE = ("train {wan_config} model.pretrained={wan} data.kind=shapes data.num_samples=1 data.frames=5 data.height=48 "
            "data.width=80 run.device=cpu run.steps=1 run.batch_size=1 run.output_dir={cwd}/runs --quiet "
            "'data.resolution=[80, 48]' 'data.frame_buckets=[1, 5]'")  # buckets the tiny Wan's rotary table holds
GENERATE_PRETRAINED = "generate --pretrained {wan} --prompt x --steps 1 --frames 5 --height 48 --width 80 --out {cwd}/v.gif --quiet"

FLAGS = [  # (command, flag, kind of its values)
    *[("generate", f, "positive_int") for f in ("--frames", "--height", "--width")],
    ("generate", "--steps", "steps"), ("generate", "--guidance", "guidance"), ("generate", "--seed", "seed"),
    ("generate", "--device", "device"), ("generate", "--out", "video_out"), ("generate", "--prompt", "text"),
    ("generate", "--timeout", "positive_float"), ("generate", "--trace", "json_out"),
    ("generate", "--ulysses", "positive_int"), ("generate", "--ring", "positive_int"),
    *[("demo", f, "positive_int") for f in ("--frames", "--height", "--width")],
    ("demo", "--steps", "steps"), ("demo", "--guidance", "guidance"), ("demo", "--seed", "seed"),
    ("demo", "--device", "device"), ("demo", "--prompt", "text"),
    *[("plan", f, "positive_int") for f in ("--frames", "--height", "--width", "--batch")],
    ("plan", "--prefetch", "natural_int"), ("plan", "--tflops", "positive_float"),
    ("plan", "--gpu-memory", "size"), ("plan", "--host-memory", "size"), ("plan", "--pcie", "bandwidth"),
    *[("simulate", f, "positive_int") for f in ("--frames", "--positions", "--gpus-per-node")],
    ("simulate", "--inter-gbps", "positive_float"), ("simulate", "--json", "json_out"),
    *[("evaluate", f, "positive_int") for f in ("--num", "--frames", "--height", "--width", "--batch-size")],
    ("evaluate", "--steps", "steps"), ("evaluate", "--guidance", "guidance"), ("evaluate", "--seed", "seed"),
    ("evaluate", "--device", "device"), ("evaluate", "--json", "json_out"),
    ("train", "--device", "device"),
    ("generate", "--pretrained", "folder_in"), ("export", "--max-shard-size", "size"),
    ("plan", "--disk", "size"), ("plan", "--disk-bandwidth", "bandwidth"),
]

# Config keys and wrong values for them (`train BASE key=value`); the error names the key.
KEYS = [
    ("optim.lr", ["0", "-1", ".nan", ".inf", "1e38", "1e6", "1e400", "abc", "[1]", "true"]),
    ("optim.eps", ["-1", "0", ".nan", ".inf"]),
    ("optim.weight_decay", ["-1", ".nan", ".inf", "abc"]),
    ("optim.betas", ["0.9", "[0.9]", "[1, 1]", "[.nan, 0.9]"]),
    ("optim.max_grad_norm", ["0", "-1", ".nan", ".inf"]),
    ("optim.ema_decay", ["0", "1", ".nan"]),
    ("optim.warmup_steps", ["-1", "1.5"]),
    ("run.name", ["..", ".", "''", "a/b", ".hidden", "-x", "'a b'"]),
    ("run.steps", ["0", "-1", "abc", "1.5", "1e3", "true", str(2**63)]),
    ("run.batch_size", ["0"]), ("run.log_every", ["0"]), ("run.save_every", ["0", "-5"]), ("run.keep_last", ["0"]),
    ("run.seed", ["-1", str(2**32), "abc"]),
    ("run.device", ["cuda:99", "tpu", "meta", "''"] + (["cuda"] if NO_CUDA else [])),
    ("run.output_dir", ["/proc/nope", "{file}", "{file}/sub", "''"]),
    ("data.frames", ["0", "-1", "abc"]), ("data.width", ["-1", "abc"]), ("data.kind", ["webdataset", "folder"]),
    ("data.num_samples", ["0"]), ("data.fps", ["0", "100000000000"]), ("data.stride", ["0"]),
    ("diffusion.logit_std", ["0", ".nan"]), ("diffusion.caption_dropout", ["1", ".nan", "-0.1"]),
    ("diffusion.logit_mean", [".nan", ".inf"]),
    ("model.hidden", ["0", "-2", "1099511627776"]), ("model.heads", ["3"]), ("model.depth", ["0", "100000000"]),
    ("model.mlp_ratio", ["0", ".nan", ".inf", "1000"]), ("model.patch_size", ["[1, 2]", "[0, 1, 1]", "5"]),
    ("model.arch", ["bogus"]), ("model.in_channels", ["4"]), ("model.text_dim", ["16"]),
    ("model.attention_options", ["'{{window: .nan}}'", "[1]"]),
    ("model", ["dit3d-tiny", "[1, 2]", "5"]), ("model.preset", ["[1]"]),
    ("offload.compute_dtype", ["fp8"]), ("offload.prefetch", ["-1"]),
    ("offload.tile", ["0", "-1", "1.5", "abc", "[2]"]), ("offload.spill_after", ["-1", "lots", "64GB"]),
    ("offload.spill_dir", ["''", "[1]"]), ("offload.overlap", ["maybe", "1", "[true]"]),
    ("offload.optimizer_threads", ["0", "-1", "1.5", "true", "all"]),
    ("lora.rank", ["0", "-1", "abc", "1.5", "true", "4"]), ("lora.alpha", ["0", "-1", ".nan"]),
    ("lora.target_modules", ["[]", "5", "['']"]), ("data.cache_dir", ["[1]"]),
    # the trainer: loop, schedules, validation, logging, datasets
    ("run.grad_accum", ["0", "-1", "1.5", "abc"]), ("run.epochs", ["0", "-1", "abc"]), ("run.wandb", ["''", "a/b", "[1]"]),
    ("optim.schedule", ["exp", "''", "[cosine]"]), ("optim.min_lr", ["-1", ".nan", "1"]),
    ("validate.every", ["0", "-1", "abc"]), ("validate.steps", ["0", "10001"]), ("validate.guidance", ["-1", ".nan"]),
    ("validate.seed", ["-1"]), ("validate.frames", ["0"]), ("validate.prompts", ["[]", "['']", "{cwd}/none.txt", "5"]),
    ("data.strict", ["maybe", "[1]"]), ("data.resolution", ["abc", "[1.5]", "[]"]), ("data.frame_buckets", ["[]", "[0]", "5"]),
    ("data.datasets", ["[]", "5", "[5]", "'[{{bogus: 1}}]'"]),
]

# Hand-written invocations: (argv, text the one error line must contain).
CASES = [
    # the command itself
    ("bogus", "invalid choice: 'bogus'"), ("train", "required: config"),
    ("generate", "required: --prompt"), ("export --out {cwd}/e", "required: --checkpoint"),
    ("export --checkpoint {ckpt}", "required: --out"), ("plan --model dit3d-tiny", "required:"),
    ("experiment", "required: experiment"), ("generate --prompt x --bogus 1", "unrecognized arguments: --bogus 1"),
    # train: config files and overrides
    ("train {cwd}/missing.yaml", "missing.yaml does not exist"), ("train {folder}", "is a folder"),
    ("train ''", "is a folder"), ("train {list_yaml}", "must hold a mapping"), ("train {scalar_yaml}", "must hold a mapping"),
    ("train {binary_yaml}", "cannot be read as text"), ("train {invalid_yaml}", "not valid YAML"),
    ("train {null_model_yaml}", "model=None must be a section"), ("train {null_run_yaml}", "run must be a mapping"),
    ("train {tiny} 'optim.lr=[1'", "optim.lr"), ("train {tiny} optim.lrr=1", "optim.lrr"), ("train {tiny} nope=1", "nope"),
    ("train {tiny} just-a-word", "section.key=value"), ("train {tiny} =1", "section.key=value"),
    ("train {tiny} optim..lr=1", "section.key=value"), ("train {tiny} .lr=1", "section.key=value"),
    ("train {tiny} run.steps.x=1", "run.steps"), ("train {tiny} data.height=15", "height=15"),
    ("train {tiny} data.max_objects=0", "max_objects"), ("train {tiny} data.max_objects=99", "max_objects"),
    ("train {tiny} model.attention=bogus", "attention='bogus'"),
    ("train {tiny} model.attention=slide 'model.attention_options={{kernel_size: [2, 7, 7]}}'", "kernel_size must be odd"),
    ("train {tiny} model.attention=slide 'model.attention_options={{kernel_size: [3, 0, 7]}}'", "kernel_size must be odd"),
    ("train {tiny} model.attention=slide 'model.attention_options={{kernel_size: [3, -7, 7]}}'", "kernel_size must be odd"),
    ("train {tiny} text_max_length=1", "max_length=1"),
    ("train {tiny} text_encoder=''", "text_encoder="), ("train {tiny} model.preset=bogus", "preset='bogus'"), ("train {tiny} autoencoder=bogus", "bogus"),
    ("train {tiny} data.height=65536 data.width=65536 run.output_dir={cwd}/r", "data.height"),
    ("train {tiny} model.preset=dit3d-105b model.in_channels=3 model.text_dim=384 run.output_dir={cwd}/r", "needs about"),
    ("train {tiny} --offload data.height=65536 data.width=65536 run.output_dir={cwd}/r", "data.height"),
    # train: resuming, starting points and the run folder
    ("train {tiny} --resume {cwd}/nowhere run.output_dir={cwd}/r", "not found"),
    ("train {tiny} --resume {file} run.output_dir={cwd}/r", "not found"),
    ("train {tiny} --init-from {cwd}/nowhere run.output_dir={cwd}/r", "not found"),
    ("train {tiny} --resume latest --init-from {ckpt} run.output_dir={cwd}/r", "--resume and --init-from"),
    ("train {tiny} --resume latest run.output_dir={cwd}/r", "not found"),
    ("train {tiny} --resume {garbage_state} run.output_dir={cwd}/r", "state.pt"),
    ("train {tiny} --resume {empty_state} run.output_dir={cwd}/r", "state.pt lacks"),
    ("train {tiny} --resume {null_model_ckpt} run.output_dir={cwd}/r", "model=None"),
    ("train {tiny} --resume {garbage_weights} run.output_dir={cwd}/r", "model.safetensors"),
    ("train {tiny} --resume {nan_ckpt} run.output_dir={cwd}/r {small}", "NaN"),
    ("train {tiny} --resume {ckpt} run.output_dir={cwd}/r model.hidden=64", "model config differs from this run's (model.hidden: "),
    ("train {tiny} --init-from {nan_ckpt} run.output_dir={cwd}/r {small}", "NaN"),
    ("train {tiny} run.output_dir={runs} {small}", "already holds checkpoint-1"),
    ("train {tiny} run.output_dir={runs} run.name=locked --resume latest {small}", "in use by another training run"),
    ("train {tiny} --quiet run.output_dir={runs} run.name=locked --resume latest {small}", "in use by another"),
    # generate
    ("generate --prompt x", "--checkpoint DIR is required"), ("generate --prompt x --init random", "--model PRESET"),
    ("generate --prompt x --init bogus", "--init"), ("generate --prompt x --init random --model bogus", "--model"),
    ("generate --prompt x --checkpoint {ckpt} --model stdit-tiny --out {cwd}/v.gif", "--model is only for --init random"),
    ("generate --prompt x --checkpoint {ckpt} --init random --model stdit-tiny --out {cwd}/v.gif", "--checkpoint"),
    ("generate --prompt x --checkpoint {cwd}/nowhere --out {cwd}/v.gif", "not found"),
    ("generate --prompt x --checkpoint {file} --out {cwd}/v.gif", "not found"),
    ("generate --prompt x --checkpoint {other_arch} --out {cwd}/v.gif", "do not fit the model"),
    ("generate --prompt x --checkpoint {nan_ckpt} --out {cwd}/v.gif", "NaN"),
    ("generate --prompt x --checkpoint {null_model_ckpt} --out {cwd}/v.gif", "model=None"),
    ("generate --prompt x --checkpoint {garbage_weights} --out {cwd}/v.gif", "model.safetensors"),
    ("{gen} --save-latents ''", "--save-latents"), ("{gen} --save-latents {cwd}/l.pt", "--save-latents"),
    ("{gen} --save-latents {folder_st}", "--save-latents"), ("{gen} --save-latents /proc/nope/l.safetensors", "--save-latents"),
    ("{gen} --frames 100000", "needs about"), ("{gen} --frames 8 --height 65536 --width 65536", "needs about"),
    ("{gen} --model dit3d-105b", "needs about"), ("{gen} --height 5", "height=5"),
    ("{gen} --parallel bogus", "--parallel"), ("{gen} --slices 0", "--slices"), ("{gen} --slices abc", "--slices"),
    ("{gen} --slices 65", "--slices"),
    # generate --pretrained: a diffusers folder sampled with its own scheduler
    ("{genp} --frames 6", "frames=6 is not allowed by this VAE; valid: 1 + 4k"),
    ("{genp} --height 44", "multiples of the VAE's 8-pixel latent cell"), ("{genp} --width 70", "multiples of the VAE"),
    ("generate --pretrained {wan} --prompt x --out {cwd}/v.gif", "--pretrained needs --frames, --height, --width"),
    ("{genp} --checkpoint {ckpt}", "--pretrained brings its own model"),
    ("{genp} --init random --model stdit-tiny", "--pretrained brings its own model"),
    ("{genp} --pretrained {folder}", "is not a diffusers model folder"),
    ("{genp} --pretrained {unsupported}", "supported: CogVideoXTransformer3DModel, HunyuanVideoTransformer3DModel"),
    ("{genp} --pretrained {missing_shard}", "missing weights shard"),
    ("{genp} --pretrained {bare}", "bare transformer folder"),
    ("{genp} --parallel ulysses", "--parallel needs a launcher"),
    # train model.pretrained=DIR: the folder, LoRA, the VAE's frame rule; nothing written on the way out
    ("{ft} model.pretrained={folder}", "is not a diffusers model folder"),
    ("{ft} model.pretrained={cwd}/nowhere", "is not a directory"),
    ("{ft} model.pretrained=''", "model.pretrained=None must be a str"), ("{ft} 'model.pretrained=\" \"'", "must name a local"),
    ("{ft} model.pretrained={unsupported}", "supported: CogVideoXTransformer3DModel, HunyuanVideoTransformer3DModel"),
    ("{ft} model.pretrained={missing_shard}", "missing weights shard"),
    ("{ft} model.pretrained={bare}", "bare transformer folder"),
    ("{ft} model.preset=dit3d-tiny", "model.preset cannot be combined with model.pretrained"),
    ("{ft} model.expert=transformer_2", "model.expert=transformer_2 is not in"),
    ("{ft} model.expert=bogus", "model.expert='bogus' is unknown"),
    ("{ft} data.frames=6", "data.frames/height/width: frames=6 is not allowed by this VAE; valid: 1 + 4k"),
    ("{ft} data.height=44", "data.frames/height/width"),
    ("{ft} data.width=1040", "exceeds this Wan's rotary table: frames, height and width / patch must each be <= rope_max_seq_len=32"),
    ("{ft} data.kind=folder data.root={cwd}/nowhere", "data.root: no such folder"),
    ("{ft} data.kind=folder data.root={folder}", "holds no image or video files (supported: .png .jpg"),
    ("{ft} run.name=off", "run.name=False must be a str; YAML reads yes/no/on/off/true/false as booleans: quote the value"),
    ("{ft} lora.rank=0", "lora.rank=0 must be a positive int"),
    ("{ft} lora.rank=4 lora.target_modules=[bogus]", "lora.target_modules: 'bogus' matches no Linear module"),
    ("{ft} --resume {ckpt}", "model config differs from this run's (model: ModelConfig in the checkpoint, PretrainedModelConfig here)"),
    # train model.pretrained=DIR model.attention=slide: the window and the swap (a window wider than the
    # token grid is no error: it is clamped, and the run says so; tests/processors/test_adapt.py)
    ("{ft} model.attention=slide 'model.attention_options={{kernel_size: [2, 3, 3]}}'",
     "model.attention_options: kernel_size must be odd and >= 1"),
    ("{ft} model.attention=slide 'model.attention_options={{kernel_size: [3, 0, 3]}}'", "kernel_size must be odd"),
    ("{ft} model.attention=slide 'model.attention_options={{kernel_size: -1}}'", "kernel_size must be odd"),
    ("{ft} model.attention=slide 'model.attention_options={{kernel_size: [3, 3]}}'", "kernel_size must be 3 ints"),
    ("{ft} model.attention=window", "model.attention='window' is not available for a pretrained model; valid: dense"),
    ("{ft} model.attention=slide 'model.attention_options={{window_size: 3}}'", "has no 'window_size'"),
    ("{ft} model.attention=slide 'model.attention_options={{max_offset: 0}}'", "max_offset=0 must be a finite number"),
    ("{ft} 'model.attention_options={{kernel_size: 3}}'", "need model.attention=slide"),
    ("{ft} model.attention=neighborhood 'model.attention_options={{offsets: sample}}'", "neighborhood has no offsets"),
    ("{ft} model.pretrained={unsupported} model.attention=slide", "supported: CogVideoXTransformer3DModel"),
    # export --format diffusers
    ("export --checkpoint {ckpt} --out {cwd}/e --format diffusers", "needs a checkpoint of a diffusers fine-tune"),
    ("export --checkpoint {ckpt} --out {cwd}/e --format bogus", "--format"),
    ("export --checkpoint {ckpt} --out {cwd}/e --max-shard-size 5GB", "--max-shard-size applies to --format diffusers"),
    # demo
    ("demo --out /proc/nope/demo.mp4", "--out"), ("demo --out {folder}", "--out"), ("demo --out ''", "--out"),
    # export: never over anything, never into or around its source
    ("export --checkpoint {ckpt} --out {existing_export}", "already exists; add --force"),
    ("export --checkpoint {ckpt} --out {ckpt}", "inside the checkpoint or run folder"),
    ("export --checkpoint {ckpt} --out {ckpt} --force", "inside the checkpoint or run folder"),
    ("export --checkpoint {run} --out {run} --force", "inside the checkpoint or run folder"),
    ("export --checkpoint {ckpt} --out {run}/export --force", "inside the checkpoint or run folder"),
    ("export --checkpoint {ckpt} --out {ckpt}/export", "inside the checkpoint or run folder"),
    ("export --checkpoint {ckpt} --out {runs} --force", "holds the checkpoint"),
    ("export --checkpoint {ckpt} --out {file}", "is an existing file"),
    ("export --checkpoint {ckpt} --out {file} --force", "is an existing file"),
    ("export --checkpoint {ckpt} --out ''", "--out"), ("export --checkpoint {ckpt} --out /proc/nope", "--out"),
    ("export --checkpoint {ckpt} --out {file}/sub", "--out"),
    ("export --checkpoint {cwd}/nowhere --out {cwd}/e", "not found"),
    ("export --checkpoint {ckpt} --out {cwd}/e --dtype int8", "--dtype"),
    ("export --checkpoint {nan_ckpt} --out {cwd}/e", "NaN"),
    ("export --checkpoint {huge_ckpt} --out {cwd}/e", "does not fit in torch.float16"),
    ("export --checkpoint {cwd} --out {cwd}/e --force", "not found"),
    # plan
    ("plan --model bogus --frames 8 --height 32 --width 32 --attention dense", "--model"),
    ("plan --model dit3d-tiny --frames 8 --height 32 --width 32 --attention bogus", "--attention"),
    *[(f"{{plan}} --vae-stride {v}", "--vae-stride") for v in ("4,8", "0,8,8", "a,b,c", "''", "4,8,8,8", "-4,8,8")],
    # simulate
    *[(f"simulate --nodes {v}", "--nodes") for v in ("0", "1,x", "''", "-1", "1,,2", "2.5")],
    ("simulate --model dit3d-tiny", "stdit"), ("simulate --model bogus", "--model"), ("simulate --scenario bogus", "--scenario"),
    ("simulate --calibration {cwd}/none.json", "--calibration"), ("simulate --calibration {folder}", "--calibration"),
    ("simulate --calibration {bad_json}", "--calibration"), ("simulate --calibration {list_json}", "--calibration"),
    ("simulate --calibration {unknown_json}", "--calibration key 'warp'"),
    ("simulate --calibration {nan_json}", "--calibration flops"), ("simulate --calibration {negative_json}", "--calibration flops"),
    ("simulate --calibration {string_json}", "--calibration flops"), ("simulate --calibration {bool_json}", "--calibration slowdown"),
    # evaluate and experiment
    ("evaluate --num 2", "--checkpoint"), ("evaluate --ground-truth --checkpoint x", "--ground-truth"),
    ("evaluate --checkpoint bundled --prompts {cwd}/none.txt", "--prompts"), ("evaluate --checkpoint bundled --prompts {folder}", "--prompts"),
    ("evaluate --checkpoint bundled --prompts {bad_prompts} --num 1", "hello world"),
    ("evaluate --checkpoint {cwd}/nowhere --num 1", "not found"),
    (f"evaluate --checkpoint bundled --seed {2**64 - 1} --num 2", "--seed"),
    ("evaluate --ground-truth --max-objects 0", "--max-objects"), ("evaluate --ground-truth --max-objects 99", "--max-objects"),
    ("experiment attention-ablation --budget bogus", "--budget"), ("experiment attention-ablation --variants bogus", "--variants"),
    ("experiment attention-ablation --out {file}", "--out"), ("experiment attention-ablation --out /proc/nope", "--out"),
    ("experiment bogus", "invalid choice"),
    # tiled blocks and spilled checkpoints (issue 12)
    ("{plan} --tile 0", "--tile"), ("{plan} --tile -2", "--tile"), ("{plan} --tile few", "--tile"),
    ("train {tiny} --offload offload.spill_dir={cwd}/nowhere run.output_dir={cwd}/r {small}", "offload.spill_dir="),
    ("train {tiny} --offload offload.spill_dir={file} run.output_dir={cwd}/r {small}", "is not an existing folder"),
    ("train {tiny} --offload offload.spill_dir=/sys run.output_dir={cwd}/r {small}", "is not writable"),
    ("train {tiny} offload.tile=2 offload.checkpoint=false run.output_dir={cwd}/r {small}", "offload.checkpoint=true"),
    ("{ft} --offload offload.tile=1 model.attention=slide",
     "offload.tile=1: blocks.0.attn1 runs SlideWanAttnProcessor; tiling WanTransformer3DModel's blocks needs its stock"),
    ("{ft} --offload offload.spill_dir={cwd}/nowhere", "offload.spill_dir="),
    # the trainer's datasets, buckets, loop and validation: one line each, before any work
    ("train {tiny} 'data.datasets=[]' data.kind=folder", "data.datasets=[] is empty"),
    ("{ft} data.kind=folder data.root={uncaptioned}", "none of its 1 files is usable (1 no caption)"),
    ("{ft} data.kind=folder 'data.datasets=[{{root: {uncaptioned}}}]' data.root=null",
     "data.datasets[0].root="),
    ("{ft} data.kind=folder data.root={uncaptioned} data.strict=true 'data.datasets=null'", "none of its 1 files"),
    ("{ft} data.kind=folder data.root={folder} 'data.frame_buckets=[1, 8]'",
     "data.frame_buckets: 8 is not allowed by this VAE; valid: 1 + 4k"),
    ("{ft} data.kind=folder data.root={folder} 'data.resolution=[90, 48]'", "data.resolution=[90, 48]: 90 is not divisible by 16"),
    ("{ft} data.kind=folder data.root={folder} data.resolution=40", "data.resolution=40: 40 is not divisible by 16"),
    ("{ft} data.kind=folder 'data.datasets=[{{root: {folder}, resolution: [48, 40]}}]' data.root=null",
     "data.datasets[0].resolution=[48, 40]: 40 is not divisible by 16"),
    ("{ft} data.kind=folder 'data.datasets=[{{root: {folder}, repeats: 0}}]' data.root=null", "data.datasets[0].repeats=0"),
    ("{ft} data.kind=folder 'data.datasets=[{{root: {folder}, frames: middle}}]' data.root=null",
     "data.datasets[0].frames='middle' is unknown; valid: head, chunk, slide, uniform"),
    ("{ft} data.kind=folder 'data.datasets=[{{root: {folder}}}]'", "data.root="),
    ("{ft} run.grad_accum=0", "run.grad_accum=0 must be >= 1"), ("{ft} optim.schedule=step", "optim.schedule='step' is unknown"),
    ("{ft} validate.prompts={cwd}/none.txt", "validate.prompts="), ("{ft} validate.every=0", "validate.every=0 must be >= 1"),
    ("{ft} 'validate.prompts=[a fox]' validate.frames=6", "validate.frames/height/width [6, 48, 80]: frames=6 is not allowed"),
    ("{ft} data.kind=folder data.root={captioned} 'validate.data=[{{root: {uncaptioned}}}]'", "validate.data[0].root="),
    ("{ft} data.kind=folder data.root={captioned} 'data.frame_buckets=[9]'", "none of its 1 files is usable (1 too short)"),
    ("train {tiny} data.kind=folder data.root={folder} data.resolution=64", "data.resolution applies to fine-tunes"),
    ("cache {tiny} run.output_dir={cwd}/r", "slidefusion cache applies to fine-tunes of diffusers folders"),
    ("train {tiny} 'validate.prompts=[a red circle]' run.output_dir={cwd}/r", "validate.prompts and validate.data apply to"),
    ("cache", "required: config"), ("cache {tiny} --bogus", "unrecognized arguments"),
    ("{cache} data.kind=folder data.root={uncaptioned}", "none of its 1 files is usable"),
]


def _table() -> list[tuple[str, str]]:
    rows = [(f"{BASE[cmd]} {flag}={shlex.quote(value) if '{' not in value else value}", flag)  # =: '-inf' is a value
            for cmd, flag, kind in FLAGS for value in BAD[kind]]
    rows += [(f"{BASE['train']} {key}={shlex.quote(value) if '{' not in value else value}", key)
             for key, values in KEYS for value in values]
    aliases = {"{gen}": BASE["generate"], "{plan}": BASE["plan"], "{genp}": GENERATE_PRETRAINED, "{ft}": FINETUNE,
               "{cache}": "cache" + FINETUNE[len("train"):]}
    for argv, needle in CASES:
        for alias, text in aliases.items():
            argv = argv.replace(alias, text)
        rows.append((argv, needle))
    return rows


TABLE = _table()


def test_the_table_is_large_enough():
    assert len(TABLE) >= 200, len(TABLE)


def _save_like(source: Path, target: Path, change) -> Path:
    """Copy checkpoint `source` to `target`, then let `change(target)` damage it."""
    shutil.copytree(source, target)
    change(target)
    return target


def _scale_weights(folder: Path, factor: float) -> None:
    for name in ("model.safetensors", "ema.safetensors"):
        weights = load_file(folder / name)
        save_file({k: v * factor for k, v in weights.items()}, folder / name)


def _diffusers_folders(root: Path) -> dict[str, Path]:
    """A tiny Wan pipeline folder, and broken ones: a class we do not support, a missing shard, a bare
    transformer folder (no text encoder or VAE)."""
    from slidefusion.testing.tiny import save_tiny_transformer, save_tiny_wan_pipeline

    wan = save_tiny_wan_pipeline(root / "wan")
    unsupported = root / "unsupported"
    shutil.copytree(wan, unsupported)
    config = json.loads((unsupported / "transformer" / "config.json").read_text())
    (unsupported / "transformer" / "config.json").write_text(json.dumps({**config, "_class_name": "FluxTransformer2DModel"}))
    missing = save_tiny_wan_pipeline(root / "missing-shard", max_shard_size="10KB")
    next(iter(sorted((missing / "transformer").glob("*-of-*.safetensors")))).unlink()
    return {"wan": wan, "unsupported": unsupported, "missing_shard": missing, "bare": save_tiny_transformer(root / "bare"),
            "wan_config": REPO / "configs" / "wan-finetune.yaml"}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Everything the table's placeholders name, built once; a run folder held locked throughout."""
    from slidefusion.training import Trainer, load_config
    from slidefusion.training.run_folder import RunLock

    root = tmp_path_factory.mktemp("bad-input")
    small = "data.frames=2 data.height=8 data.width=8 run.batch_size=2 run.steps=1"
    config = load_config(REPO / "configs" / "tiny.yaml", [*small.split(), f"run.output_dir={root / 'runs'}"])
    ckpt = Trainer(config, quiet=True).train().last_checkpoint
    run = ckpt.parent
    shutil.copytree(run, root / "runs" / "locked")
    lock = RunLock(root / "runs" / "locked")
    lock.acquire()
    damaged = root / "damaged"
    other = json.loads((ckpt / "config.json").read_text())
    other["model"] = {**other["model"], "arch": "stdit"}
    paths = {
        "root": root, "tiny": REPO / "configs" / "tiny.yaml", "runs": root / "runs", "run": run, "ckpt": ckpt,
        "small": small, "folder": root / "a-folder", "folder_json": root / "a-folder.json",
        "folder_st": root / "a-folder.safetensors", "file": root / "file.txt",
        "existing_export": root / "an-export",
        "garbage_state": _save_like(ckpt, damaged / "state", lambda p: (p / "state.pt").write_bytes(b"\x80\x03garbage")),
        "empty_state": _save_like(ckpt, damaged / "empty", lambda p: torch.save({"x": 1}, p / "state.pt")),
        "null_model_ckpt": _save_like(ckpt, damaged / "null", lambda p: (p / "config.json").write_text('{"model": null}')),
        "garbage_weights": _save_like(ckpt, damaged / "weights", lambda p: (p / "model.safetensors").write_bytes(b"junk")),
        "other_arch": _save_like(ckpt, damaged / "other", lambda p: (p / "config.json").write_text(json.dumps(other))),
        "nan_ckpt": _save_like(ckpt, damaged / "nan", lambda p: _scale_weights(p, float("nan"))),
        "huge_ckpt": _save_like(ckpt, damaged / "huge", lambda p: _scale_weights(p, 1e9)),
    }
    for name in ("folder", "folder_json", "folder_st", "existing_export"):
        paths[name].mkdir()
    (paths["existing_export"] / "mine.txt").write_text("the user's")
    paths["file"].write_text("a file")
    texts = {"list_yaml": "- 1\n- 2\n", "scalar_yaml": "5\n", "invalid_yaml": "model: [unclosed\n",
             "null_model_yaml": "model: null\n", "null_run_yaml": "run: null\n", "bad_json": "{not json",
             "list_json": "[1, 2]", "unknown_json": '{"warp": 9}', "nan_json": '{"flops": NaN}',
             "negative_json": '{"flops": -1}', "string_json": '{"flops": "fast"}', "bool_json": '{"slowdown": true}',
             "bad_prompts": "hello world\n"}
    for name, text in texts.items():
        paths[name] = root / f"{name}.{name.split('_')[-1].replace('prompts', 'txt')}"
        paths[name].write_text(text)
    paths.update(_diffusers_folders(root))
    from slidefusion.testing.media import make_folder

    paths["uncaptioned"] = make_folder(root / "uncaptioned", [("a.mp4", 5, 48, 80)], captions=False)
    paths["captioned"] = make_folder(root / "captioned", [("a.mp4", 5, 48, 80)])
    paths["binary_yaml"] = root / "binary.yaml"
    paths["binary_yaml"].write_bytes(bytes(range(128, 256)))
    paths["cwd"] = root / "cwd"
    paths["cwd"].mkdir()
    yield {k: str(v) for k, v in paths.items()}
    lock.release()


def _snapshot(*folders: Path) -> dict[str, tuple[int, int]]:
    """Every folder, and every file's (size, mtime), under `folders`, skipping caches and the venv.
    A folder's own mtime is left out: a run lock may create and remove a folder inside it; a run
    lock file's content (its holder's pid) may change."""
    skip = {".venv", ".git", "__pycache__", ".pytest_cache", ".ruff_cache"}
    seen = {}
    for folder in folders:
        for parent, dirs, files in os.walk(folder):
            dirs[:] = [d for d in dirs if d not in skip]
            seen.update({os.path.join(parent, d): (-1, -1) for d in dirs})
            for name in files:
                stat = os.lstat(os.path.join(parent, name))
                seen[os.path.join(parent, name)] = (stat.st_size, stat.st_mtime_ns) if name != ".lock" else (0, 0)
    return seen


@pytest.mark.parametrize("argv, needle", TABLE, ids=[f"{i:03d} {argv[-50:]}" for i, (argv, _) in enumerate(TABLE)])
def test_a_malformed_invocation_exits_2_with_one_line(world, argv, needle, capsys, monkeypatch):
    args = shlex.split(argv.format(**world))
    monkeypatch.chdir(world["cwd"])
    before = _snapshot(Path(world["root"]), REPO)
    code = main(args)
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert code == 2, (args, code, err)
    assert len(lines) == 1 and err.endswith("\n"), (args, err)
    assert lines[0].startswith("slidefusion") and ": error: " in lines[0], lines[0]
    assert "Traceback" not in err and needle in lines[0], (needle, lines[0])
    assert _snapshot(Path(world["root"]), REPO) == before, args
