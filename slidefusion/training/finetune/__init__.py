"""Fine-tuning a diffusers pipeline folder (`model.pretrained=DIR`): config sections, the latent and
text caches, the family's own loss, LoRA, the trainer's task for a folder, and export back to a
diffusers folder. Import the modules themselves (this package imports nothing, so that the config
module can be read by `slidefusion.training.config` without a cycle)."""
