"""Sizing before building: what a policy needs on the host, the device and the disk, whether it
fits, and the numbers its `auto` values stand for."""
