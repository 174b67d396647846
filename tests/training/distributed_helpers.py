"""What the spawned ranks of tests/training/test_distributed.py run (module-level, so they import).

Each group function runs several cases in one process group (starting ranks is the slow part) and
returns what the parent compares with single-process runs: losses and weights of short training
runs, gradients, host bytes, and what the CLI printed on each rank for bad input."""

import contextlib
import io
import os
import time

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")

STEPS = 3
GLOBAL = 4  # samples per step, whatever the ranks


# A clipping threshold no gradient reaches: the clipped path (norms summed over ranks, updates after
# backward) with a factor of exactly 1, so its runs equal unclipped ones. An active threshold would
# hide a wrong gradient scale (clipping and Adam undo it); the engine case `copying` clips for real.
LOOSE_CLIP = "optim.max_grad_norm=1e6"


def overrides(out, name: str, batch: int, *extra) -> list[str]:
    """A tiny run of our DiT3D: `batch` samples per data-parallel rank, fp32."""
    return ["model.preset=dit3d-tiny", "data.frames=2", "data.height=8", "data.width=8", f"run.batch_size={batch}",
            f"run.steps={STEPS}", "run.log_every=1", "run.save_every=2", f"run.output_dir={out}", f"run.name={name}",
            "optim.warmup_steps=1", "optim.max_grad_norm=null", "optim.eps=1e-3", "optim.lr=3e-3", "optim.ema_decay=null",
            *extra]


def folder_overrides(folder, out, name: str, batch: int, *extra) -> list[str]:
    """A tiny Wan folder fine-tune with LoRA, offloaded."""
    return [f"model.pretrained={folder}", "data.kind=shapes", "data.num_samples=3", "data.frames=5", "data.height=48",
            "data.width=80", f"run.batch_size={batch}", f"run.steps={STEPS}", "run.save_every=3", "run.log_every=1",
            f"run.output_dir={out}", f"run.name={name}", "optim.lr=1e-3", "optim.eps=1e-3", "optim.warmup_steps=0",
            "offload.compute_dtype=float32", "offload.enabled=true", "lora.rank=4", "run.device=cpu", *extra]


def train(args: list[str], config_file: str | None = None) -> dict:
    """Run the trainer (rank-0 writes, the others compute); the mean losses and final weights."""
    from slidefusion.training import Trainer, load_config

    trainer = Trainer(load_config(config_file, args), quiet=True)
    with trainer.lock():
        result = trainer.train()
    weights = {k: v.clone() for k, v in trainer.task.weights(trainer.optimizer.model_state_dict()).items()}
    stats = getattr(trainer.optimizer, "stats", None)
    if hasattr(trainer.optimizer, "close"):
        trainer.optimizer.close()
    return {"losses": result.losses, "weights": weights, "stats": None if stats is None else stats.as_dict()}


def resume(args: list[str], checkpoint) -> dict:
    """Continue `checkpoint` (a folder) to STEPS in the run named by `args`."""
    from slidefusion.training import Trainer, load_config

    trainer = Trainer(load_config(None, args), quiet=True)
    with trainer.lock():
        trainer.resume(checkpoint)
        result = trainer.train()
    return {"losses": result.losses, "weights": dict(trainer.optimizer.model_state_dict())}


def engine_run(rank: int, world: int, **options) -> dict:
    """The engine itself on a CPU device with copy threads (as a GPU's), a resident block and
    clipping (and `options` for its policy): rank `rank`'s rows of each step's batch (world 1: one
    process, no ranks)."""
    from slidefusion.models import build_model, preset
    from slidefusion.offload import OffloadEngine, OffloadPolicy
    from slidefusion.offload.engine.sharded import make_rank_groups
    from slidefusion.optim import OptimConfig

    torch.manual_seed(0)
    model = build_model(preset("dit3d-tiny", depth=3, text_dim=16))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn_like(param))
    optim = OptimConfig(lr=3e-3, eps=1e-3, weight_decay=0.1, max_grad_norm=0.05, warmup_steps=0, ema_decay=None)
    local_world = options.pop("local_world", world)  # fewer: as many nodes, the shards meet by all-gather
    options = {"zero_copy": False, "resident_blocks": 1, **options}
    policy = OffloadPolicy(device="cpu", compute_dtype=torch.float32, optim=optim, **options)
    ranks = make_rank_groups(local_world, True, 60) if world > 1 else None
    engine = OffloadEngine(model, model.blocks, policy, ranks=ranks)
    rows = slice(rank * GLOBAL // world, (rank + 1) * GLOBAL // world)

    def loss(m, step):
        g = torch.Generator().manual_seed(step)
        x, t, c = torch.randn(GLOBAL, 3, 2, 4, 4, generator=g), torch.rand(GLOBAL, generator=g), torch.randn(GLOBAL, 5, 16, generator=g)
        return (m(x[rows], t[rows], c[rows]) - 0.5 * x[rows]).pow(2).mean()

    losses = [engine.train_step(lambda m, s=step: loss(m, s)) for step in range(STEPS)]
    weights = {k: v.clone() for k, v in engine.model_state_dict().items()}
    engine.close()
    return {"losses": losses, "weights": weights}


def cli(argv: list[str]) -> tuple[int, str]:
    """`slidefusion ARGV` in this process: (exit code, what it printed on stderr)."""
    from slidefusion.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


def sp_gradients(rank: int, world: int, name: str) -> dict:
    """One loss and every gradient of a model run sequence-parallel (Ulysses) over the world, the
    parameter gradients summed over the ranks (each holds its tokens' part)."""
    import torch.distributed as dist

    from slidefusion.parallel import ParallelConfig, parallelize

    model, loss_fn = sp_case(name)
    parallelize(model, ParallelConfig("ulysses", 1, timeout_s=60))
    loss = loss_fn(model)
    loss.backward()
    grads = {}
    for key, param in model.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        dist.all_reduce(grad)
        grads[key] = grad
    return {"loss": loss.item(), "grads": grads}


def sp_case(name: str):
    """(model, loss of the model) for the sequence-parallel gradient check."""
    from slidefusion.testing.tiny import tiny_latents, tiny_model, tiny_text

    if name == "wan":
        from slidefusion.families import adapter_for

        model = tiny_model("wan")
        latents = tiny_latents(model, 1, (2, 6, 10))
        text = tiny_text(model, 1, lengths=[5])

        def loss(m):
            out = adapter_for(m).raw_output(m, latents, torch.tensor([500]), text)
            return (out - latents.flip(-1)).pow(2).mean()
        return model, loss
    from slidefusion.models import build_model, preset

    torch.manual_seed(0)
    model = build_model(preset("dit3d-tiny", hidden=40, heads=5, text_dim=16))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn_like(param))
    g = torch.Generator().manual_seed(1)
    x, context = torch.randn(1, 3, 3, 6, 10, generator=g), torch.randn(1, 5, 16, generator=g)
    return model, lambda m: (m(x, torch.tensor([0.3]), context) - x.flip(-1)).pow(2).mean()


def bad_input(root: str, rank: int) -> dict:
    """What each bad invocation prints on this rank, and its exit code."""
    cases = {
        "sp does not divide": overrides(root, "bad1", 1, "parallel.sp=3"),
        "sp > heads": overrides(root, "bad2", 1, "parallel.sp=2", "model.heads=1"),
        "configs differ": overrides(root, "bad3", 1, f"run.seed={rank}"),
        "fsdp with offload": overrides(root, "bad4", 1, "parallel.fsdp=true", "offload.enabled=true"),
        "sp with tiles": overrides(root, "bad5", 1, "parallel.sp=2", "offload.enabled=true", "offload.tile=1"),
    }
    out = {name: cli(["train", "configs/tiny.yaml", *args, "--quiet"]) for name, args in cases.items()}
    other = overrides(root, "bad6", 2, "model.preset=stdit-tiny")  # resume the resident case's run with another model
    out["another model"] = cli(["train", "configs/tiny.yaml", *other, "--resume", f"{root}/resident/checkpoint-2", "--quiet"])
    return out


def two_ranks(rank: int, world: int, root: str, wan_folder: str) -> dict:
    torch.set_num_threads(1)
    out = {}
    timings = {}
    for name, extra in (("resident", ()), ("fsdp", ("parallel.fsdp=true",)),
                        ("offload", ("offload.enabled=true", "offload.overlap=true", "offload.resident_blocks=1", LOOSE_CLIP)),
                        ("lean", ("offload.enabled=true", "offload.master=bf16", "offload.moments=int8", LOOSE_CLIP)),
                        ("replicated", ("offload.enabled=true", "parallel.shared_host=false"))):
        start = time.perf_counter()
        out[name] = train(overrides(root, name, GLOBAL // world, *extra))
        timings[name] = time.perf_counter() - start
    out["sp"] = train(overrides(root, "sp", GLOBAL, "offload.enabled=true", f"parallel.sp={world}"))
    out["copying"] = engine_run(rank, world)
    out["tiled"] = engine_run(rank, world, tile=1, zero_copy=True, resident_blocks=0)
    out["lora"] = train(folder_overrides(wan_folder, root, "lora", 1), "configs/wan-finetune.yaml")
    out["sp_grads"] = {name: sp_gradients(rank, world, name) for name in ("dit3d", "wan")}
    out["bad"] = bad_input(root, rank)
    out["timings"] = timings
    return out


def four_ranks(rank: int, world: int, root: str, checkpoint: str) -> dict:
    torch.set_num_threads(1)
    return {"offload": train(overrides(root, "offload4", GLOBAL // world, "offload.enabled=true", LOOSE_CLIP)),
            "two_nodes": engine_run(rank, world, local_world=2),
            "dp_sp": train(overrides(root, "dpsp", GLOBAL // 2, "offload.enabled=true", "parallel.sp=2")),
            "resumed": resume(overrides(root, "resumed4", GLOBAL // world, "offload.enabled=true", LOOSE_CLIP), checkpoint)}


def dies_mid_run(rank: int, world: int, root: str, err_folder: str) -> int:
    """The CLI on every rank; rank 1 ends itself after its second step. Each rank's stderr goes to a
    file (a rank that loses its peer leaves with os._exit, past any Python capture)."""
    with open(os.path.join(err_folder, f"rank{rank}.err"), "w") as sink:
        os.dup2(sink.fileno(), 2)
    from slidefusion.training import trainer as trainer_module

    log = trainer_module.Trainer._log

    def dying_log(self, *args):
        log(self, *args)
        if rank == 1 and self.step == 2:
            with open(os.path.join(err_folder, "died"), "w") as note:
                note.write(repr(time.time()))
            os._exit(3)
    trainer_module.Trainer._log = dying_log
    from slidefusion.cli import main

    return main(["train", "configs/tiny.yaml", *overrides(root, "dies", 1, "run.steps=50", "parallel.timeout_s=5",
                                                         "offload.enabled=true"), "--quiet"])
