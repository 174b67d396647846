"""Text -> video: our own models (`VideoPipeline`) and diffusers pipeline folders or fine-tunes of them
(`FolderPipeline`), both with diffusers' call names (`pipe(prompt, num_frames=..., num_inference_steps=...,
guidance_scale=..., generator=..., output_type=...).frames`) next to `latents` / `decode`.

    pipe = VideoPipeline.from_pretrained(path)     # a diffusers folder, a checkpoint, an export, a run folder
"""

from slidefusion.pipeline.call import OUTPUT_TYPES, VideoPipelineOutput, save_latents
from slidefusion.pipeline.folder import FolderPipeline, is_diffusers_folder
from slidefusion.pipeline.ours import DEFAULT_PROMPT, VideoPipeline, bundled_checkpoint

__all__ = ["DEFAULT_PROMPT", "OUTPUT_TYPES", "FolderPipeline", "VideoPipeline", "VideoPipelineOutput",
           "bundled_checkpoint", "is_diffusers_folder", "save_latents"]
