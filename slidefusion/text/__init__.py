"""Text conditioning: frozen encoders behind `TextEncoder`, and a cache of caption embeddings."""

from slidefusion.text.cache import CaptionCache
from slidefusion.text.encoder import HFTextEncoder, MiniLMEncoder, TextEncoder, build_text_encoder

__all__ = ["CaptionCache", "HFTextEncoder", "MiniLMEncoder", "TextEncoder", "build_text_encoder"]
