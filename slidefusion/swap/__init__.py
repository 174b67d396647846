"""Slide attention inside real models: `use_slide_attention(transformer, ...)` swaps the video
self-attention of a supported diffusers video transformer (Wan, CogVideoX, HunyuanVideo, Mochi,
LTX-Video, Latte) or of our DiT3D / STDiT for 3D deformable slide attention, reversibly
(`handle.remove()` or `restore_attention(transformer)`). See `apply.py`; what each family needs is
its `SwapRecord` (`slidefusion.families`)."""

from slidefusion.swap.apply import (
    SlideAttentionHandle,
    restore_attention,
    slide_attention_handle,
    use_slide_attention,
)
from slidefusion.swap.config import (
    PRETRAINED_ATTENTION,
    configured_options,
    is_offset_weight,
    slide_offset_weights,
    use_configured_attention,
)
from slidefusion.swap.processor import GridState, SitePlan, SlideProcessor
from slidefusion.swap.records import SlideOptions

__all__ = ["PRETRAINED_ATTENTION", "GridState", "SitePlan", "SlideAttentionHandle", "SlideOptions",
           "SlideProcessor", "configured_options", "is_offset_weight", "restore_attention", "slide_attention_handle", "slide_offset_weights",
           "use_configured_attention", "use_slide_attention"]
