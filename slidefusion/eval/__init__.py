"""Offline measures of generated videos."""

from slidefusion.eval.colour import centroid_track, dominant_colour

__all__ = ["centroid_track", "dominant_colour"]
