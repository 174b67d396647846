"""MkDocs hook: every page under docs/design/ joins the Design section of the nav, so a new design
page needs no edit of mkdocs.yml (and a missing one breaks nothing)."""

from pathlib import Path


def on_config(config):
    design = sorted(p.relative_to(config["docs_dir"]).as_posix()
                    for p in Path(config["docs_dir"], "design").glob("*.md"))
    for entry in config["nav"]:
        if isinstance(entry, dict) and "Design" in entry:
            pages = entry["Design"]
            pages.extend(page for page in design if page not in pages)
    return config
