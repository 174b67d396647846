"""Activation memory: blocks run tile by tile, the block-boundary store and its spill file, and the
activation model the planner sizes them with."""
