"""Local diffusers folders: check them, build their transformer on the meta device, stream its
weights shard by shard, load the other components, encode prompts and sample as the folder's own
pipeline does. Local files only, never a hub.

    folder = open_folder("Wan2.1-T2V-1.3B-Diffusers")
    model = load_transformer(folder, dtype=torch.bfloat16)        # resident
    meta = build_on_meta(folder); pairs = iter_weights(folder)    # for the offload engine
    [(tokenizer, text_encoder)] = load_text_encoders(folder); vae = load_vae(folder)
    parts = PretrainedParts.load(folder)                          # everything, for sampling
    latents = sample_latents(parts, Request("a cat", frames=33, height=480, width=832))
"""

import os

# Belt and braces: every load passes local_files_only, and the hub clients read these at import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from slidefusion.pretrained.build import (  # noqa: E402
    assign_weights,
    build_on_meta,
    iter_weights,
    load_transformer,
    transformer_class,
)
from slidefusion.pretrained.components import load_component, load_scheduler, load_text_encoders, load_vae  # noqa: E402
from slidefusion.pretrained.folder import Expert, PretrainedFolder, open_folder, weight_entries  # noqa: E402
from slidefusion.pretrained.parts import PretrainedParts, folder_adapter, require_pipeline  # noqa: E402
from slidefusion.pretrained.prompts import encode_prompts  # noqa: E402
from slidefusion.io.safetensors_stream import TensorEntry, read_header, stream_tensors  # noqa: E402
from slidefusion.pretrained.sampling import (  # noqa: E402
    Request,
    check_generation,
    decode,
    denoise,
    denoise_loop,
    initial_noise,
    latent_shape,
    parts_latent_shape,
    sample_latents,
    set_schedule,
)

__all__ = ["Expert", "PretrainedFolder", "PretrainedParts", "Request", "TensorEntry", "assign_weights", "build_on_meta",
           "check_generation", "decode", "denoise", "denoise_loop", "encode_prompts", "folder_adapter", "initial_noise", "iter_weights", "latent_shape",
           "load_component", "load_scheduler", "load_text_encoders", "load_transformer", "load_vae", "open_folder",
           "parts_latent_shape", "read_header", "require_pipeline", "sample_latents", "set_schedule", "stream_tensors",
           "transformer_class", "weight_entries"]
