"""Files slidefusion reads and writes, each format defined once, below the pipelines and training.

    files.py               atomic writes: a file or folder appears complete or not at all
    checkpoint.py          our checkpoint layout (config.json, model/ema safetensors, state.pt)
    config.py              typed config records from YAML, JSON and key=value overrides, and back
    diffusers.py           the diffusers folder layout: which kind a folder is, its sharded weights
    safetensors_stream.py  safetensors shards read one tensor at a time
    export.py              export formats: a diffusers pipeline folder, a diffusers LoRA file
"""
