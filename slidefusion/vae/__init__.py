"""Video autoencoders behind `Autoencoder`: pixel space (identity) or a diffusers video VAE."""

from slidefusion.vae.base import (
    Autoencoder,
    DiffusersVideoAutoencoder,
    IdentityAutoencoder,
    build_autoencoder,
    check_decoded,
)

__all__ = ["Autoencoder", "DiffusersVideoAutoencoder", "IdentityAutoencoder", "build_autoencoder", "check_decoded"]
