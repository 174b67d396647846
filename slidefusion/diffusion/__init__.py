"""Rectified-flow objective and Euler sampler with classifier-free guidance."""

from slidefusion.diffusion.flow import FlowConfig, contrastive_flow_loss, flow_loss, interpolate, sample_timesteps
from slidefusion.diffusion.rows import Rows
from slidefusion.diffusion.sampler import guided_velocity, sample, timestep_schedule

__all__ = ["FlowConfig", "Rows", "contrastive_flow_loss", "flow_loss", "interpolate", "sample_timesteps", "guided_velocity", "sample", "timestep_schedule"]
