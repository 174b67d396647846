"""Files slidefusion reads and writes, each format defined once, below the pipelines and training.

    files.py               atomic writes: a file or folder appears complete or not at all
    checkpoint.py          our checkpoint layout (config.json, model/ema safetensors, state.pt)
    config.py              typed config records from YAML, JSON and key=value overrides, and back
    diffusers.py           the diffusers folder layout: which kind a folder is, its sharded weights
    safetensors_stream.py  safetensors shards read one tensor at a time
    export.py              export formats: a diffusers pipeline folder, a diffusers LoRA file
    wan_layout.py          Wan's original key names <-> diffusers', both directions (a family's `layout`)
    comfyui.py             ComfyUI's files: a LoRA for models/loras, a transformer for models/diffusion_models
    single_file.py         a single-file transformer's header under diffusers' names, checked against a model
    lora_files.py          LoRA files in either layout we export, read back as adapters under diffusers' names

Nothing heavy is imported here: each module is imported where it is used.
"""
