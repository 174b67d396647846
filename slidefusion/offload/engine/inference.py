"""Forward passes outside training (validation samples, a held-out loss) on an engine's model.

    with streamed_inference(engine):
        out = engine.model(x, t, text)        # every call streams the blocks from the host weights

The engine's hooks already run a block without a graph when gradients are off; what a forward
outside `train_step` needs besides is the start of each pass (the pending updates applied, the
rest of the model bound to its device copy, the block stream started) and the compute dtype's
autocast. No second copy of the weights is made: the blocks stream through the same device slots
as in training, from the same host buffers.
"""

from contextlib import contextmanager

import torch

from slidefusion.offload.engine.engine import _refresh_written_weights
from slidefusion.offload.engine.layout import REST


@contextmanager
def streamed_inference(engine):
    """Within: every forward of `engine.model` streams from the engine's host weights, without a graph."""
    engine.synchronize()

    def begin_pass(module, args, kwargs):
        _refresh_written_weights(engine)  # weights written through the model (init_from) since the last step
        engine._wait_update(REST)
        engine.weights.begin_pass(forward=True)
        engine._pos, engine._called = 0, []

    handle = engine.model.register_forward_pre_hook(begin_pass, with_kwargs=True)
    dtype = engine.policy.compute_dtype
    try:
        with torch.no_grad(), torch.autocast(engine.device.type, dtype=dtype, enabled=dtype != torch.float32):
            yield
    finally:
        handle.remove()
        engine.state.rest.bind_host()
