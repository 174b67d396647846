"""How a block runs under the engine: a hook on the unchanged block, an autograd function, a store.

Each block's `forward` is replaced, on the instance, by `BlockHook`, which routes the call through
`StreamedBlock`: an autograd function that checkpoints at the block boundary. Its forward runs the
block without a graph on streamed weights; its backward re-acquires the weights (in reverse order),
recomputes the block with a graph, ships the weight gradients and returns the input gradients.

Two seams for tiling and spilling (issue 12):
  `run_block(block, params, args, kwargs)` is the whole computation of one block on given weights;
      the engine calls `engine.run_block`, which a tiler may wrap.
  `KeptCheckpoints` is where a block's inputs wait for its backward; a store with the same two
      methods can move them elsewhere (host memory, disk).
"""

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


def run_block(block: torch.nn.Module, params: dict[str, torch.Tensor], args, kwargs):
    """The block's own forward with `params` (local name -> tensor) in place of its parameters."""
    return torch.func.functional_call(block, params, args, kwargs)


class KeptCheckpoints:
    """Block-boundary checkpoints kept where they are (device memory), as autograd would keep them."""

    def put(self, ctx, tensors: list) -> None:
        ctx.save_for_backward(*[t if torch.is_tensor(t) else None for t in tensors])
        ctx.others = [None if torch.is_tensor(t) else t for t in tensors]

    def take(self, ctx) -> list:
        return [s if o is None else o for s, o in zip(ctx.saved_tensors, ctx.others)]


def forward_with_graph(engine, index: int, weights: torch.Tensor, tensors: list, spec):
    """Run block `index` on the flat `weights` with a graph: (outputs, (leaves, inputs, outputs)).

    One leaf per trainable parameter: a single flat leaf would make autograd build a zero-filled
    flat-sized gradient for every view of it, then add them all up. Frozen parameters are plain views."""
    group = engine.state.blocks[index]
    views = group.layout.views(weights)
    with torch.enable_grad():
        leaves = [view.detach().requires_grad_() for view in views[:len(group.trainable)]]
        inputs = [t.detach().requires_grad_(t.requires_grad) if torch.is_tensor(t) else t for t in tensors]
        args, kwargs = tree_unflatten(inputs, spec)
        out = engine.call_block(index, leaves + views[len(group.trainable):], args, kwargs)
    return out, (leaves, inputs, out)


def input_and_weight_grads(graph, grad_outputs) -> tuple[list, list]:
    """(gradients of the inputs that require grad, in input order with None elsewhere; weight gradients)."""
    leaves, inputs, out = graph
    outs, _ = tree_flatten(out)
    pairs = [(o, g) for o, g in zip(outs, grad_outputs) if torch.is_tensor(o) and o.requires_grad and g is not None]
    wanted = [t for t in inputs if torch.is_tensor(t) and t.requires_grad]
    if not pairs or not (wanted + leaves):
        return [None] * len(inputs), [None] * len(leaves)
    grads = torch.autograd.grad([o for o, _ in pairs], wanted + leaves, [g for _, g in pairs], allow_unused=True)
    by_input = iter(grads[:len(wanted)])
    return [next(by_input) if torch.is_tensor(t) and t.requires_grad else None for t in inputs], list(grads[len(wanted):])


class BlockHook:
    """Stands in for `block.forward` on the instance; routes calls through the engine."""

    def __init__(self, engine, index: int, original):
        self.engine, self.index, self.original = engine, index, original

    def __call__(self, *args, **kwargs):
        if self.engine.in_block:  # the engine itself running the block with streamed weights
            return self.original(*args, **kwargs)
        tensors, spec = tree_flatten((args, kwargs))
        if not torch.is_grad_enabled():
            out, _ = self.engine.block_forward(self.index, tensors, spec)
            return out
        outs = StreamedBlock.apply(self.engine, self.index, spec, self.engine.anchor, *tensors)
        return tree_unflatten(list(outs), self.engine.out_spec)


class StreamedBlock(torch.autograd.Function):
    """One block as a checkpoint: forward without a graph, backward recomputes (see the module)."""

    @staticmethod
    def forward(ctx, engine, index, spec, anchor, *tensors):
        out, graph = engine.block_forward(index, list(tensors), spec)
        outs, engine.out_spec = tree_flatten(out)
        ctx.engine, ctx.index, ctx.spec, ctx.graph = engine, index, spec, graph
        ctx.autocast = torch.is_autocast_enabled(engine.device.type)
        engine.checkpoints.put(ctx, list(tensors))
        return tuple(o.detach() if torch.is_tensor(o) else o for o in outs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        tensors = ctx.engine.checkpoints.take(ctx)
        engine = ctx.engine
        with torch.autocast(engine.device.type, dtype=engine.policy.compute_dtype, enabled=ctx.autocast):
            grads = engine.block_backward(ctx.index, tensors, ctx.spec, ctx.graph, grad_outputs)
        ctx.graph = None
        return (None, None, None, None, *grads)


def install_hooks(engine) -> None:
    for index, block in enumerate(engine.blocks):
        block.forward = BlockHook(engine, index, block.forward)


def remove_hooks(engine) -> None:
    for block in engine.blocks:
        if isinstance(block.__dict__.get("forward"), BlockHook):
            del block.forward
