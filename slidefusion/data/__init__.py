"""Datasets of captioned videos: procedural moving shapes and folders of real clips.

Every dataset yields {"video": float32 (3, T, H, W) in [-1, 1], "caption": str}.
"""

import inspect

from torch.utils.data import Dataset

from slidefusion.data.folder import VideoFolder
from slidefusion.data.shapes import (
    BACKGROUNDS,
    COLORS,
    DIRECTIONS,
    SHAPES,
    SPEEDS,
    MovingShapes,
    ObjectDescription,
    SceneDescription,
    ShapeObject,
    ShapeScene,
    caption,
    describe,
    object_centers,
    parse_caption,
    render,
    sample_scene,
)
from slidefusion.data.video_io import from_uint8, read_video, to_uint8, write_video
from slidefusion.core.errors import UserError, unknown_value

DATASETS: dict[str, type[Dataset]] = {"shapes": MovingShapes, "folder": VideoFolder}


def build_dataset(kind: str, **kwargs) -> Dataset:
    """The dataset registered as `kind` ("shapes" or "folder"), built from keyword arguments.

    Bad keywords become a UserError too, because they usually come straight from a config file.
    """
    if kind not in DATASETS:
        raise unknown_value("data.kind", kind, DATASETS)
    cls = DATASETS[kind]
    signature = inspect.signature(cls)
    try:
        signature.bind(**kwargs)
    except TypeError as err:
        valid = ", ".join(signature.parameters)
        raise UserError(f"dataset {kind!r}: {err}; valid arguments: {valid}") from err
    return cls(**kwargs)


__all__ = [
    "BACKGROUNDS", "COLORS", "DATASETS", "DIRECTIONS", "SHAPES", "SPEEDS",
    "MovingShapes", "ObjectDescription", "SceneDescription", "ShapeObject", "ShapeScene", "VideoFolder",
    "build_dataset", "caption", "describe", "from_uint8", "object_centers", "parse_caption",
    "read_video", "render", "sample_scene", "to_uint8", "write_video",
]
