"""The data of a fine-tune: what clips exist (`FolderData`), which step trains which, and the
randomness of each sample.

Order of work, cheap first: the buckets a config allows are derived and checked against the VAE
and the transformer (`rules_for`, `check_buckets`) before any file is opened, so the memory plan
can be sized by the largest; then every file is probed (`slidefusion.data.sources.scan`) and the
skip table printed, before anything is encoded.

A step trains one batch of `run.batch_size x run.grad_accum` clips of one bucket (`BucketBatches`),
cut into `grad_accum` micro-batches of `batch_size`. Each sample's caption dropout, timestep and
noise come from its own generator, seeded by (run seed, step, position in the step's batch): so
the micro-batches of a step draw exactly what one batch of all of them would, and
`grad_accum=N` trains as a batch N times larger.
"""

from __future__ import annotations

import hashlib

import torch

from slidefusion.data.buckets import Bucket, BucketBatches, check_frame_buckets, format_bucket_table, target_area
from slidefusion.data.sources import Rules, format_table, scan
from slidefusion.core.errors import UserError


def sample_generator(seed: int, step: int, position: int) -> torch.Generator:
    """Sample `position` of step `step`'s batch: its own random stream."""
    digest = hashlib.sha256(f"sample:{seed}:{step}:{position}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def rules_for(data, temporal: int, step: int) -> Rules:
    """The buckets `data` asks for, each checked against the VAE's frame rule and the pixel step."""
    if data.frame_buckets is not None:
        frames = check_frame_buckets(list(data.frame_buckets), temporal)
    else:
        frames = [data.frames]
    area = target_area(data.resolution, step, "data.resolution") if data.resolution is not None else None
    for source, key in data.sources() if data.kind == "folder" else ():
        if source.resolution is not None:
            target_area(list(source.resolution), step, f"{key}.resolution")
    return Rules(tuple(frames), (data.height, data.width), area, step)


def candidate_buckets(data, rules: Rules) -> list[Bucket]:
    """Every bucket a clip could land in (aspect buckets x frame buckets, fixed source sizes)."""
    sides = set(rules.sides())
    for source, _ in data.sources() if data.kind == "folder" else ():
        if source.resolution is not None:
            sides.add((source.resolution[1], source.resolution[0]))
    return [Bucket(f, h, w) for f in rules.frame_buckets for h, w in sorted(sides)]


def check_buckets(buckets: list[Bucket], latent_of, what: str) -> Bucket:
    """`latent_of(bucket)` for each (a UserError names the bucket); the bucket with most latent tokens."""
    sizes = {}
    for bucket in buckets:
        try:
            sizes[bucket] = latent_of(bucket)
        except UserError as error:
            raise UserError(f"{what}: bucket {bucket} (frames x height x width): {error}") from None
    return max(sizes, key=lambda b: (_tokens(sizes[b]), b))


def _tokens(shape) -> int:
    count = 1
    for size in shape[2:]:
        count *= int(size)
    return count


class FolderData:
    """The clips of a fine-tune (`dataset`: a `ClipSet`, or the procedural shapes), their buckets
    and the batches of every step. Prints the skip table (real files) unless `quiet`."""

    def __init__(self, config, rules: Rules | None, quiet: bool, batch_size: int | None = None):
        """`batch_size`: the samples of one micro-batch over all data-parallel ranks (default
        run.batch_size, one process)."""
        from slidefusion.training.task import dataset_of

        data, run = config.data, config.run
        self.batch_size, self.accum = batch_size or run.batch_size, run.grad_accum
        if data.kind == "folder":
            self.dataset, reports = scan(data.sources(), rules, data.strict)
            skipped = sum(len(v) for r in reports for v in r.skipped.values())
            if not quiet:
                print(format_table(reports))
            elif skipped:
                print(f"data: {skipped} file(s) skipped (run without --quiet for the table)")
            buckets, repeats = self.dataset.buckets, self.dataset.repeats
        else:
            if data.ignored_buckets() and not quiet:
                print(data.ignored_buckets())
            self.dataset = dataset_of(data)
            buckets, repeats = [Bucket(data.frames, data.height, data.width)] * len(self.dataset), [1] * len(self.dataset)
        # every micro-batch full (a bucket's last batch completed from its start), so each data-parallel rank
        # has its rows and N ranks train exactly what one process does with N times the batch
        self.batches = BucketBatches(buckets, repeats, self.batch_size * run.grad_accum, run.seed, self.batch_size)

    @property
    def steps_per_epoch(self) -> int:
        return self.batches.per_epoch

    def table(self) -> str:
        return format_bucket_table(self.batches, self.accum)

    def micro_batches(self, step: int) -> list[list[tuple[int, int]]]:
        """Step `step`'s batch as micro-batches of (position in the step's batch, sample index)."""
        batch = list(enumerate(self.batches.batch(step)))
        return [batch[k:k + self.batch_size] for k in range(0, len(batch), self.batch_size)]

    def caption(self, index: int) -> str:
        return dataset_caption(self.dataset, index)


def dataset_caption(dataset, index: int) -> str:
    """A clip's caption without decoding its video where the dataset allows."""
    if hasattr(dataset, "captions"):
        return dataset.captions[index]
    if hasattr(dataset, "scene"):
        from slidefusion.data import caption

        return caption(dataset.scene(index))
    return dataset[index]["caption"]


def data_rules(data, adapter, model, vae_config) -> tuple[Rules, Bucket]:
    """The buckets of `data` for a folder's VAE and transformer (`model`: meta is enough), each
    checked (a UserError names the key and the bucket), and the one with the most latent tokens."""
    from slidefusion.pretrained import latent_shape
    from slidefusion.vae.base import is_image_vae_class, video_vae_factors

    config = vae_config if hasattr(vae_config, "get") else vars(vae_config)
    temporal, spatial = video_vae_factors(config)
    temporal = 1 if is_image_vae_class(config.get("_class_name", "")) else int(temporal or 1)
    step = int(spatial or 1) * max(adapter.patch_size(model)[1:])
    rules = rules_for(data, temporal, step) if data.kind == "folder" else None
    if data.kind != "folder":  # the procedural shapes: one size (`FolderData` notes ignored bucket keys)
        rules = Rules((data.frames,), (data.height, data.width), None, step)
    bucketed = data.kind == "folder" and (data.resolution is not None or data.frame_buckets is not None
                                          or any(s.resolution for s, _ in data.sources()))
    latent_of = lambda b: latent_shape(adapter, model, vae_config, b.frames, b.height, b.width)  # noqa: E731
    if not bucketed:  # the single size of the fixed keys, named as before
        only = Bucket(data.frames, data.height, data.width)
        try:
            latent_of(only)
        except UserError as error:
            raise UserError(f"data.frames/height/width: {error}") from None
        return rules, only
    what = "data.frame_buckets / data.resolution"
    return rules, check_buckets(candidate_buckets(data, rules), latent_of, what)


class ClipSizes:
    """The run's clip sizes for `pretrained.source.open_source`: called with the folder's adapter,
    meta model and VAE config, it checks every bucket (`data_rules`), keeps the `rules` and returns
    the largest bucket's (frames, height, width), which sizes the latents and the memory plan."""

    def __init__(self, data):
        self.data, self.rules = data, None

    def __call__(self, adapter, model, vae_config: dict) -> tuple[int, int, int]:
        self.rules, largest = data_rules(self.data, adapter, model, vae_config)
        return largest.frames, largest.height, largest.width


def micro_batch_loss(task, part: list[tuple[int, int]], step: int, weight: float,
                     image_generator: torch.Generator | None = None):
    """The loss of one micro-batch of a `FolderTask` as a function of the model, scaled by `weight`
    (its share of the step's clips): cached latents and text, each sample's caption dropout,
    timestep and noise from `sample_generator`."""
    seed, dropout = task.config.run.seed, task.config.diffusion.caption_dropout
    generators = [sample_generator(seed, step, position) for position, _ in part]
    indices = [index for _, index in part]
    captions = ["" if torch.rand((), generator=g).item() < dropout else task.captions[i]
                for g, i in zip(generators, indices)]
    latents = task.cache.latents(indices)
    t, noise = task.objective.draw(latents.shape, task.adapter.tokens(task.model, latents.shape), generators)
    latents, t, noise = latents.to(task.device), t.to(task.device), noise.to(task.device)
    text = task.cache.text(captions)
    text = type(text)(text.states.to(task.device), None if text.mask is None else text.mask.to(task.device),
                      None if text.pooled is None else text.pooled.to(task.device))
    if getattr(task, "image_mode", None) is not None:  # image-to-video: the clips' first frames, cached
        text = task.cache.with_image(text, indices, task.config.diffusion.image_dropout, image_generator, task.device)

    def loss(model) -> torch.Tensor:
        value = task.objective.loss_at(model, latents, text, t, noise)
        return value if weight == 1.0 else value * weight

    return loss
