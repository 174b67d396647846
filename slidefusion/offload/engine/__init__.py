"""The engine: host buffers per block, block streaming, gradient shipping and the step loop."""
