"""Slide attention inside real models: `use_slide_attention(transformer, ...)` swaps the video
self-attention of a supported diffusers video transformer (Wan, CogVideoX, HunyuanVideo, Mochi,
LTX-Video, Latte) or of our DiT3D / STDiT for 3D deformable slide attention, reversibly
(`handle.remove()` or `restore_attention(transformer)`). See `swap.py`."""

from slidefusion.processors.config import (
    PRETRAINED_ATTENTION,
    configured_options,
    is_offset_weight,
    slide_offset_weights,
    use_configured_attention,
)
from slidefusion.processors.processor import GridState, SitePlan, SlideProcessor
from slidefusion.processors.records import SWAP_RECORDS, SlideOptions, SwapRecord
from slidefusion.processors.swap import (
    SlideAttentionHandle,
    restore_attention,
    slide_attention_handle,
    use_slide_attention,
)

__all__ = ["PRETRAINED_ATTENTION", "SWAP_RECORDS", "GridState", "SitePlan", "SlideAttentionHandle", "SlideOptions",
           "SlideProcessor", "SwapRecord", "configured_options", "is_offset_weight", "restore_attention", "slide_attention_handle", "slide_offset_weights",
           "use_configured_attention", "use_slide_attention"]
