"""Weights on disk in other programs' layouts: Wan's original key names (`wan_layout`), ComfyUI
exports (`comfyui`) and original-layout single-file transformers read by streaming (`single_file`).

Nothing heavy is imported here: each module is imported where it is used.
"""
