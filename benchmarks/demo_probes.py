"""Why does a moving-shapes model follow colour but not direction or shape? Cheap probes (issue 16).

Each probe prints a table and adds its numbers to OUT/demo-probes-TAG.json:
  data       the training data's bounce rate: how often a clip captioned "moving X" ends up, after
             its frames, displaced along X (net heading = caption) or mostly against X.
  text       MiniLM token states of captions that differ in one attribute only: relative L2
             distance of the states, largest per-token cosine distance, cosine of the mean-pooled
             sentence embeddings. Colour and background (learned) against direction and shape.
  loss       does the model's prediction depend on each attribute? The flow loss on held-out
             clips at fixed flow times t, with the true caption and with the colour, shape or
             direction changed (or the caption left empty): loss(changed) - loss(true) > 0 means
             the model uses that part of the prompt at that noise level.
  attention  where cross-attention looks: the share of attention mass on the tokens of each part
             of the caption (colour, shape, direction, speed, background, the rest), per block.
  swap       sampling: the same seeds with "moving left/right/up/down"; the detector's heading
             and displacement per video, how often left and right give opposite horizontal motion
             (and up/down vertical), and how much the video changes (mean |pixel| difference)
             when the direction, the colour, or the whole text (states zeroed) changes.
  timesteps  the share of training flow times above 0.8 / 0.9 for logit-normal laws.
  oracle     what an ideal (Bayes) denoiser gains from each caption part, for comparison with
             `loss`: E[x0 | x_t, caption] by importance sampling over --oracle-candidates scenes that
             fit the caption (sizes and starts drawn as the data draws them), flow loss with the
             caption changed minus with the true caption. Finite sampling makes the absolute gaps
             rough; their order is what counts.
  flow       where the caption reaches the video tokens: for a fixed x_t, the spread across the 8
             colours, 4 shapes or 8 directions of each block's output (variance across prompts over
             mean square), block by block and at the velocity head.

    python benchmarks/demo_probes.py --checkpoint bundled          # every probe (~5 min, 2 cores)
    python benchmarks/demo_probes.py --checkpoint runs/X --probes loss swap
"""

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slidefusion.data.shapes import (  # noqa: E402
    COLORS,
    DIRECTIONS,
    SHAPES,
    SIZE_RANGE,
    START_RANGE,
    MovingShapes,
    ShapeScene,
    caption,
    object_centers,
    render,
    with_start,
)
from slidefusion.data.video_io import from_uint8  # noqa: E402
from slidefusion.eval import detect  # noqa: E402
from slidefusion.eval.evaluate import PROMPT_SEED  # noqa: E402

OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up", "up-left": "down-right",
            "down-right": "up-left", "up-right": "down-left", "down-left": "up-right"}
PROBES = ("data", "text", "loss", "attention", "swap", "timesteps", "oracle", "flow")


def probe_data(args, pipe) -> dict:
    """Bounce statistics of the training distribution (the pipeline's data config, or 32x32x8)."""
    data_cfg = pipe.config.data if pipe else None
    frames, height, width = (data_cfg.frames, data_cfg.height, data_cfg.width) if data_cfg else (8, 32, 32)
    start = data_cfg.start if data_cfg else "uniform"
    data = MovingShapes(args.data_clips, frames, height, width, seed=0, max_objects=1, start=start)
    names = list(DIRECTIONS)
    units = np.array([DIRECTIONS[n] for n in names])
    out: dict[str, dict] = {}
    for i in range(args.data_clips):
        obj = data.scene(i).objects[0]
        centres = object_centers(obj, frames, height, width)
        steps = np.diff(centres, axis=0) @ np.array(DIRECTIONS[obj.direction])  # progress per frame
        net = centres[-1] - centres[0]
        heading = names[int(np.argmax(units @ net))]
        key = f"{obj.speed}, {'diagonal' if '-' in obj.direction else 'axis'}"
        row = out.setdefault(key, {"clips": 0, "bounced": 0, "net_heading_ok": 0, "mostly_backwards": 0})
        row["clips"] += 1
        row["bounced"] += bool(np.any(np.abs(np.diff(centres, axis=0) - np.diff(centres, axis=0)[0]) > 1e-9))
        row["net_heading_ok"] += heading == obj.direction
        row["mostly_backwards"] += bool((steps < 0).sum() > (frames - 1) / 2)
    print(f"\n## data: {args.data_clips} training clips, {frames} frames of {height}x{width}, start={start}")
    print("| speed, direction | clips | some bounce | net heading = caption | most frames backwards |\n|---|---|---|---|---|")
    for key, row in sorted(out.items()):
        n = row["clips"]
        print(f"| {key} | {n} | {row['bounced'] / n:.3f} | {row['net_heading_ok'] / n:.3f} | {row['mostly_backwards'] / n:.3f} |")
    return out


def _caption(color="red", shape="circle", direction="right", speed="quickly", background="black") -> str:
    article = "an" if color[0] in "aeiou" else "a"
    return f"{article} {color} {shape} moving {direction} {speed} on a {background} background"


TEXT_PAIRS = {
    "color": [("red", "blue"), ("green", "yellow"), ("red", "orange")],
    "shape": [("circle", "square"), ("triangle", "diamond"), ("circle", "triangle")],
    "direction": [("right", "left"), ("up", "down"), ("up-left", "down-right"), ("up-right", "up-left")],
    "speed": [("quickly", "slowly")],
    "background": [("black", "gray"), ("gray", "navy")],
}


def probe_text(args, pipe) -> dict:
    encoder = pipe.text_encoder
    print("\n## text: MiniLM states of captions differing in one attribute (base: 'a red circle moving right quickly on a black background')")
    print("| attribute | pair | relative L2 of the token states | largest token cosine distance | pooled cosine similarity |\n|---|---|---|---|---|")
    out = {}
    for attribute, pairs in TEXT_PAIRS.items():
        for a, b in pairs:
            states, mask = encoder.encode([_caption(**{attribute: a}), _caption(**{attribute: b})])
            sa, sb = states[0][mask[0]], states[1][mask[1]]
            pooled = torch.nn.functional.cosine_similarity(sa.mean(0), sb.mean(0), dim=0).item()
            rel = cos = float("nan")
            if sa.shape == sb.shape:
                rel = ((sa - sb).norm() / sa.norm()).item()
                cos = (1 - torch.nn.functional.cosine_similarity(sa, sb, dim=1)).max().item()
            out[f"{attribute}:{a}/{b}"] = {"relative_l2": rel, "max_token_cos_distance": cos, "pooled_cos": pooled}
            print(f"| {attribute} | {a} / {b} | {rel:.3f} | {cos:.3f} | {pooled:.4f} |")
    return out


def _held_out(pipe, num: int):
    data_cfg = pipe.config.data
    data = MovingShapes(num, data_cfg.frames, data_cfg.height, data_cfg.width, seed=PROMPT_SEED, max_objects=1,
                        start=data_cfg.start)  # clips as the model was trained on them
    scenes = [data.scene(i) for i in range(num)]
    return scenes, torch.stack([data[i]["video"] for i in range(num)])


def _changed(scene, **change) -> str:
    return caption(replace(scene, objects=(replace(scene.objects[0], **change),)))


def _variants(scenes) -> dict[str, list[str]]:
    colours = list(COLORS)
    return {
        "true": [caption(s) for s in scenes],
        "colour changed": [_changed(s, color=colours[(colours.index(s.objects[0].color) + 3) % len(colours)]) for s in scenes],
        "shape changed": [_changed(s, shape=SHAPES[(SHAPES.index(s.objects[0].shape) + 1) % len(SHAPES)]) for s in scenes],
        "direction reversed": [_changed(s, direction=OPPOSITE[s.objects[0].direction]) for s in scenes],
        "empty caption": [""] * len(scenes),
    }


@torch.no_grad()
def probe_loss(args, pipe) -> dict:
    scenes, x0 = _held_out(pipe, args.clips)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    encoded = {name: pipe.text_encoder.encode(prompts) for name, prompts in _variants(scenes).items()}
    print(f"\n## loss: flow loss on {args.clips} held-out clips, with the caption changed (as loss - loss with the true caption)")
    print("| t | true caption | " + " | ".join(list(encoded)[1:]) + " |\n|" + "---|" * (len(encoded) + 1))
    out = {}
    for t in args.times:
        times = torch.full((len(scenes),), t)
        xt = (1 - t) * x0 + t * noise
        losses = {name: ((pipe.model(xt, times, *text) - (noise - x0)) ** 2).mean().item() for name, text in encoded.items()}
        out[str(t)] = losses
        base = losses["true"]
        print(f"| {t} | {base:.5f} | " + " | ".join(f"{v - base:+.5f}" for k, v in losses.items() if k != "true") + " |")
    return out


def _part_spans(prompt: str, scene) -> dict[str, tuple[int, int]]:
    """Character spans of each attribute's words in `prompt`."""
    obj, spans, cursor = scene.objects[0], {}, 0
    for part, word in (("colour", obj.color), ("shape", obj.shape), ("direction", obj.direction),
                       ("speed", obj.speed), ("background", scene.background)):
        start = prompt.index(word, cursor)
        spans[part] = (start, start + len(word))
        cursor = start + len(word)
    return spans


@torch.no_grad()
def probe_attention(args, pipe) -> dict:
    """Cross-attention mass per caption part, recomputed from each block's inputs (forward hooks)."""
    scenes, x0 = _held_out(pipe, args.clips)
    prompts = [caption(s) for s in scenes]
    tok = pipe.text_encoder.tokenizer(prompts, padding="longest", truncation=True,
                                      max_length=pipe.text_encoder.max_length, return_offsets_mapping=True)
    parts = ("colour", "shape", "direction", "speed", "background", "rest")
    labels = torch.full((len(prompts), len(tok["input_ids"][0])), parts.index("rest"))
    for i, (prompt, scene) in enumerate(zip(prompts, scenes)):
        for j, (a, b) in enumerate(tok["offset_mapping"][i]):
            for k, (lo, hi) in enumerate(_part_spans(prompt, scene).values()):
                if b > a and a < hi and b > lo:
                    labels[i, j] = k
    states, mask = pipe.text_encoder.encode(prompts)
    captured = []

    def hook(module, inputs, output):
        x, context, m = inputs
        b, n, c = x.shape
        q = module.q(x).view(b, n, module.heads, -1).transpose(1, 2)
        k = module.kv(context).view(b, -1, 2, module.heads, c // module.heads)[:, :, 0].transpose(1, 2)
        logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        logits = logits.masked_fill(~m[:, None, None, :], float("-inf"))
        captured.append(logits.softmax(-1).mean((1, 2)))  # (B, L): mass per text token

    handles = [block.cross_attn.register_forward_hook(hook) for block in pipe.model.blocks]
    out, noise = {}, torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    print(f"\n## attention: cross-attention mass on each caption part ({args.clips} held-out clips, all heads and video tokens)")
    print("| t | block | " + " | ".join(parts) + " |\n|" + "---|" * (len(parts) + 2))
    try:
        for t in (0.5, 0.9):
            captured.clear()
            pipe.model((1 - t) * x0 + t * noise, torch.full((len(prompts),), t), states, mask)
            for block, mass in enumerate(captured):
                shares = [float((mass * (labels == k)).sum(1).mean()) for k in range(len(parts))]
                out[f"t={t}, block {block}"] = dict(zip(parts, shares))
                print(f"| {t} | {block} | " + " | ".join(f"{s:.3f}" for s in shares) + " |")
    finally:
        for handle in handles:
            handle.remove()
    return out


@torch.no_grad()
def probe_swap(args, pipe) -> dict:
    seeds = list(range(args.seeds))
    prompts = {d: f"a red circle moving {d} quickly on a black background" for d in ("left", "right", "up", "down")}
    prompts["blue"] = "a blue circle moving right quickly on a black background"
    videos = {name: pipe.decode_batch(pipe.latents_batch([p] * len(seeds), seeds, steps=args.steps)) for name, p in prompts.items()}
    moves = {}
    for name, batch in videos.items():
        colour = "blue" if name == "blue" else "red"
        rows = []
        for video in batch:
            track = detect(video, colour)
            c = track.centroid[track.present]
            rows.append({"heading": track.heading, "dy": float(c[-1, 0] - c[0, 0]) if len(c) > 1 else 0.0,
                         "dx": float(c[-1, 1] - c[0, 1]) if len(c) > 1 else 0.0})
        moves[name] = rows
    opposite_x = sum(l["dx"] < 0 < r["dx"] for l, r in zip(moves["left"], moves["right"]))
    opposite_y = sum(u["dy"] < 0 < d["dy"] for u, d in zip(moves["up"], moves["down"]))
    diff = lambda a, b: float((videos[a] - videos[b]).abs().mean())  # noqa: E731
    zeroed = pipe.decode_batch(_zero_text_latents(pipe, prompts["right"], seeds, args.steps))
    out = {"headings": {k: [r["heading"] for r in v] for k, v in moves.items()}, "moves": moves,
           "left_right_opposite": opposite_x, "up_down_opposite": opposite_y, "seeds": len(seeds),
           "pixel_change": {"right -> left": diff("right", "left"), "right -> up": diff("right", "up"),
                            "red -> blue": diff("right", "blue"),
                            "right -> text zeroed": float((videos["right"] - zeroed).abs().mean())}}
    print(f"\n## swap: seeds 0-{len(seeds) - 1}, {args.steps} Euler steps, guidance 4, 'a red circle moving D quickly on a black background'")
    print("| prompt | headings (detector) |\n|---|---|")
    for name, heads in out["headings"].items():
        print(f"| {name} | {', '.join(str(h) for h in heads)} |")
    print(f"left vs right opposite horizontal motion: {opposite_x}/{len(seeds)}; up vs down opposite vertical: {opposite_y}/{len(seeds)}")
    print("mean |pixel change| (videos in [-1, 1]): " + ", ".join(f"{k} {v:.4f}" for k, v in out["pixel_change"].items()))
    return out


def _zero_text_latents(pipe, prompt, seeds, steps):
    """Sampling with the conditional text states replaced by zeros (mask kept): is the text used at all?"""
    from slidefusion.diffusion import sample

    data = pipe.config.data
    latent = pipe.autoencoder.latent_shape(data.frames, data.height, data.width)
    noise = torch.cat([torch.randn((1, *latent), generator=torch.Generator().manual_seed(s)) for s in seeds])
    states, mask = pipe.text_encoder.encode([prompt] * len(seeds))
    uncond = pipe.text_encoder.encode([""] * len(seeds))
    return sample(pipe.model, tuple(noise.shape), (torch.zeros_like(states), mask), uncond, steps=steps,
                  guidance=4.0, progress=False, noise=noise)


def probe_timesteps(args, pipe) -> dict:
    out = {}
    print("\n## timesteps: share of training flow times t = sigmoid(N(mean, std)) in the high-noise band")
    print("| logit mean | logit std | P(t > 0.8) | P(t > 0.9) | P(t < 0.2) |\n|---|---|---|---|---|")
    for mean, std in ((0.0, 1.0), (0.5, 1.0), (1.0, 1.0), (1.0, 1.2)):
        tail = lambda x: 0.5 * math.erfc((math.log(x / (1 - x)) - mean) / (std * math.sqrt(2)))  # noqa: E731
        row = {"p_above_0.8": tail(0.8), "p_above_0.9": tail(0.9), "p_below_0.2": 1 - tail(0.2)}
        out[f"{mean},{std}"] = row
        print(f"| {mean} | {std} | {row['p_above_0.8']:.3f} | {row['p_above_0.9']:.3f} | {row['p_below_0.2']:.3f} |")
    return out


def _candidates(obj, background: str, count: int, start: str, clip, rng) -> torch.Tensor:
    """`count` rendered clips (K, 3, T, H, W) with `obj`'s caption words and fresh sizes and starts."""
    frames, height, width = clip
    videos = []
    for _ in range(count):
        cand = replace(obj, size=float(rng.uniform(*SIZE_RANGE)), start_y=float(rng.uniform(*START_RANGE)),
                       start_x=float(rng.uniform(*START_RANGE)))
        cand = with_start(cand, start, frames, height, width)
        videos.append(from_uint8(render(ShapeScene((cand,), background), frames, height, width)))
    return torch.stack(videos)


def _bayes_loss(xt, noise, x0, t, candidates) -> float:
    """Flow loss of the posterior-mean velocity over `candidates` (a prior sample) given x_t."""
    log_w = -((xt - (1 - t) * candidates) ** 2).flatten(1).sum(1) / (2 * t * t)
    x0_hat = (torch.softmax(log_w, 0)[:, None, None, None, None] * candidates).sum(0)
    return (((xt - x0_hat) / t - (noise - x0)) ** 2).mean().item()  # v = noise - x0 = (x_t - x0) / t


@torch.no_grad()
def probe_oracle(args, pipe) -> dict:
    data_cfg = pipe.config.data
    clip = (data_cfg.frames, data_cfg.height, data_cfg.width)
    scenes, x0s = _held_out(pipe, args.oracle_clips)
    colours, rng, out = list(COLORS), np.random.default_rng(0), {}
    changes = {"colour changed": lambda o: replace(o, color=colours[(colours.index(o.color) + 3) % len(colours)]),
               "shape changed": lambda o: replace(o, shape=SHAPES[(SHAPES.index(o.shape) + 1) % len(SHAPES)]),
               "direction reversed": lambda o: replace(o, direction=OPPOSITE[o.direction])}
    print(f"\n## oracle: an ideal denoiser's flow-loss gap when the caption is changed ({args.oracle_clips} clips, "
          f"{args.oracle_candidates} candidate scenes per caption, start={data_cfg.start})")
    print("| t | ideal loss, true caption | " + " | ".join(changes) + " |\n|" + "---|" * (len(changes) + 2))
    for t in args.oracle_times:
        noise_gen, gaps, bases = torch.Generator().manual_seed(1), {k: [] for k in changes}, []
        for scene, x0 in zip(scenes, x0s):
            noise = torch.randn(x0.shape, generator=noise_gen)
            xt, obj = (1 - t) * x0 + t * noise, scene.objects[0]
            def loss(o):
                return _bayes_loss(xt, noise, x0, t, _candidates(o, scene.background, args.oracle_candidates, data_cfg.start, clip, rng))
            bases.append(loss(obj))
            for name, change in changes.items():
                gaps[name].append(loss(change(obj)) - bases[-1])
        out[str(t)] = {"true": float(np.mean(bases)), **{k: float(np.mean(v)) for k, v in gaps.items()}}
        print(f"| {t} | {out[str(t)]['true']:.5f} | " + " | ".join(f"+{out[str(t)][k]:.5f}" for k in changes) + " |")
    return out


def _flow_prompts(part: str) -> list[str]:
    if part == "colour":
        return [_caption(color=c) for c in COLORS]
    if part == "shape":
        return [_caption(shape=s) for s in SHAPES]
    return [_caption(direction=d) for d in DIRECTIONS]


@torch.no_grad()
def probe_flow(args, pipe) -> dict:
    model, out = pipe.model, {}
    _, x0s = _held_out(pipe, 4)
    print("\n## flow: spread of each block's output across prompts differing in one part (fixed x_t; 4 clips)")
    print("| t | part | " + " | ".join(f"block {i}" for i in range(len(model.blocks))) + " | velocity |\n|"
          + "---|" * (len(model.blocks) + 3))
    for t in (0.5, 0.9, 0.99):
        for part in ("colour", "shape", "direction"):
            prompts = _flow_prompts(part)
            states, mask = pipe.text_encoder.encode(prompts)
            spread = torch.zeros(len(model.blocks) + 1)
            for i, x0 in enumerate(x0s):
                noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(i))
                xt = ((1 - t) * x0 + t * noise)[None].expand(len(prompts), -1, -1, -1, -1)
                tokens, c, context = model.embed(xt, torch.full((len(prompts),), t), states, mask)
                outputs = []
                for block in model.blocks:
                    tokens = block(tokens, c, context, mask)
                    outputs.append(tokens)
                outputs.append(model.head(tokens, c))
                spread += torch.tensor([(h.var(0).mean() / h.pow(2).mean()).item() for h in outputs]) / len(x0s)
            out[f"t={t}, {part}"] = spread.tolist()
            print(f"| {t} | {part} | " + " | ".join(f"{v:.1e}" for v in spread.tolist()) + " |")
    out["projection"] = _projection_distances(pipe)
    return out


def _projection_distances(pipe) -> dict:
    """Relative distance of two captions' token states at MiniLM's output, after the model's text
    projection, and as block 0's cross-attention values: what the text pathway keeps or shrinks."""
    model, out = pipe.model, {}
    print("\n| caption pair (base: red circle, right, black) | MiniLM states | text projection | block 0 values |\n|---|---|---|---|")
    rel = lambda a, b: float((a - b).norm() / a.norm())  # noqa: E731
    for part, change in (("colour", dict(color="blue")), ("shape", dict(shape="square")),
                         ("direction", dict(direction="left")), ("background", dict(background="gray"))):
        states, mask = pipe.text_encoder.encode([_caption(), _caption(**change)])
        a, b = states[0][mask[0]], states[1][mask[1]]
        pa, pb = model.text_proj(a), model.text_proj(b)
        kv = model.blocks[0].cross_attn.kv
        va, vb = kv(pa)[:, model.config.hidden:], kv(pb)[:, model.config.hidden:]
        out[part] = {"minilm": rel(a, b), "text_proj": rel(pa, pb), "values": rel(va, vb)}
        print(f"| {part} | {rel(a, b):.3f} | {rel(pa, pb):.3f} | {rel(va, vb):.3f} |")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default="bundled", help="checkpoint or run folder, or 'bundled'")
    p.add_argument("--probes", nargs="+", choices=PROBES, default=list(PROBES))
    p.add_argument("--clips", type=int, default=32, help="held-out clips for the loss and attention probes")
    p.add_argument("--times", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98])
    p.add_argument("--seeds", type=int, default=8, help="seeds for the swap probe")
    p.add_argument("--steps", type=int, default=20, help="Euler steps for the swap probe")
    p.add_argument("--data-clips", type=int, default=20000)
    p.add_argument("--oracle-clips", type=int, default=12)
    p.add_argument("--oracle-candidates", type=int, default=1500)
    p.add_argument("--oracle-times", type=float, nargs="+", default=[0.8, 0.9, 0.95, 0.99])
    p.add_argument("--out", default="outputs/benchmarks")
    p.add_argument("--tag", help="names the JSON, OUT/demo-probes-TAG.json (default: the checkpoint folder's name)")
    args = p.parse_args(argv)
    from slidefusion.pipeline import VideoPipeline

    torch.set_grad_enabled(False)
    pipe = VideoPipeline.from_checkpoint(None if args.checkpoint == "bundled" else args.checkpoint)
    path = Path(args.out) / f"demo-probes-{args.tag or Path(args.checkpoint).name}.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    results.update(checkpoint=args.checkpoint, torch=torch.__version__, threads=torch.get_num_threads())
    for name in args.probes:
        start = time.perf_counter()
        results[name] = globals()[f"probe_{name}"](args, pipe)
        print(f"({name}: {time.perf_counter() - start:.0f} s)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(results, indent=2))
    tmp.replace(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
