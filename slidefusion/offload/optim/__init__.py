"""The host optimizer: AdamW on flat buffers in each storage format, its C kernels and update timing."""
