"""Text -> video: our own models (`VideoPipeline`) and diffusers pipeline folders or fine-tunes of them
(`FolderPipeline`), both with diffusers' call names (`pipe(prompt, num_frames=..., num_inference_steps=...,
guidance_scale=..., generator=..., output_type=...).frames`) next to `latents` / `decode`.

    pipe = VideoPipeline.from_pretrained(path)     # a diffusers folder, a checkpoint, an export, a run folder
    latents = pipe.latents(prompt, parallel=ParallelConfig("ulysses", 2))   # inside a process group: across its ranks
"""

from slidefusion.pipeline.call import OUTPUT_TYPES, VideoPipelineOutput, save_latents
from slidefusion.pipeline.folder import FolderPipeline, is_diffusers_folder
from slidefusion.pipeline.ours import DEFAULT_PROMPT, VideoPipeline, bundled_checkpoint
from slidefusion.pipeline.spawn import generate, generate_pretrained

__all__ = ["DEFAULT_PROMPT", "OUTPUT_TYPES", "FolderPipeline", "VideoPipeline", "VideoPipelineOutput",
           "bundled_checkpoint", "generate", "generate_pretrained", "is_diffusers_folder", "save_latents"]
