"""Load a pipeline folder's other components (text encoders, tokenizers, VAE, scheduler) from disk.

Each component's class comes from model_index.json and is looked up in the library it names
(diffusers or transformers only: a folder cannot make us import anything else), then loaded with
`local_files_only=True`: nothing ever comes from a hub.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from slidefusion.errors import UserError, check
from slidefusion.pretrained.folder import PretrainedFolder, open_folder

LIBRARIES = ("diffusers", "transformers")


def load_component(folder: PretrainedFolder | str | Path, name: str, **kwargs):
    """Component `name` of a pipeline folder (e.g. "vae", "text_encoder", "tokenizer", "scheduler")."""
    folder = folder if isinstance(folder, PretrainedFolder) else open_folder(folder)
    library, class_name = folder.component_class(name)
    path = folder.component_dir(name)
    check(library in LIBRARIES, f"pretrained={folder.root}: component {name} comes from library {library!r}; "
                                f"valid: {', '.join(LIBRARIES)}")
    cls = getattr(importlib.import_module(library), class_name, None)
    if cls is None and name.startswith("tokenizer"):  # saved by another transformers version
        from transformers import AutoTokenizer as cls
    check(cls is not None, f"pretrained={folder.root}: component {name} is a {library}.{class_name}, "
                           f"which this {library} version does not have")
    _quiet_loaders()
    if name == "scheduler":
        folder.scheduler_config()  # NaN shifts and the like, in one line, before the class reads them
    try:
        return cls.from_pretrained(str(path), local_files_only=True, **kwargs)
    except Exception as err:  # noqa: BLE001 - a damaged file (a cut shard, a garbage tokenizer.json) can make
        # a loader raise nearly anything: SafetensorError, KeyError, ...; "not on disk" comes as OSError or ValueError
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"pretrained={folder.root}: component {name}/ does not load ({type(err).__name__}: {reason}); "
                        "the files are damaged or incomplete (an interrupted download?): fetch them again") from None


def _quiet_loaders() -> None:
    """No per-component "Loading weights" bars from transformers and diffusers on every command."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    diffusers_logging.disable_progress_bar()


def load_text_encoders(folder: PretrainedFolder | str | Path, **kwargs) -> list[tuple[object, object]]:
    """[(tokenizer, text encoder)] in the order the family's pipeline uses them (HunyuanVideo: two)."""
    folder = folder if isinstance(folder, PretrainedFolder) else open_folder(folder)
    spec = folder.adapter().text
    check(spec is not None, f"pretrained={folder.root}: its model takes no text encoder")
    return [(load_component(folder, tok), load_component(folder, enc, **kwargs).eval())
            for tok, enc in zip(spec.tokenizers, spec.encoders)]


def load_vae(folder: PretrainedFolder | str | Path, **kwargs):
    return load_component(folder, "vae", **kwargs).eval()


def load_scheduler(folder: PretrainedFolder | str | Path):
    return load_component(folder, "scheduler")
