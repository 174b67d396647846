"""How a block runs under the engine: a hook on the unchanged block, an autograd function, a store.

Each block carries the hook `STREAM` (the one registry, `slidefusion.core.hooks`), `BlockHook`, which
routes the call through `StreamedBlock`: an autograd function that checkpoints at the block boundary.
Its forward runs the block without a graph on streamed weights; its backward re-acquires the weights
(in reverse order), recomputes the block with a graph, ships the weight gradients and returns the
input gradients. The engine runs the block itself inside the hook's call (or `within` it, in
backward), so those calls reach the block's own forward below the hook.

Two seams:
  a block runner, `engine.runner`: `forward(block, params, args, kwargs)` is the whole computation
      of one block on given weights, `grads(...)` its recompute and backward. `WholeBlock` runs
      the block in one piece; `tiled.TiledBlock` runs it tile by tile.
  a checkpoint store, `engine.checkpoints`: where a block's inputs wait for its backward.
      `KeptCheckpoints` keeps them where they are; `checkpoints.SpilledCheckpoints` moves them to
      host memory and a spill file. Both also hear when a step begins, turns to backward, and ends.
"""

import contextvars

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from slidefusion.core import hooks

STREAM = "offload"
# Tiled resident blocks and the parallel plans run their own forward per block; streaming the
# same blocks under them would run each block twice or on another rank's tokens.
REFUSED = {"tiling": "tile_blocks checkpoints resident blocks; use OffloadPolicy(tile=...) for tiled streaming",
           "parallel": "the parallel plans split inference over ranks; detach them before offloading"}


def refused(ranked: bool) -> dict[str, str]:
    """The hooks a model may not carry when the engine attaches. An engine on several ranks
    (`ranks=`) trains sequence-parallel with the Ulysses hooks of its sample's ranks on the blocks
    (`training.dist_optim.sequence_parallel`): it streams the hooked blocks, whose hooks then run as
    the blocks' own forward, in the forward and in the recompute alike."""
    return {k: v for k, v in REFUSED.items() if not (ranked and k == "parallel")}


class WholeBlock:
    """Runs a block in one piece: its own forward; gradients by recomputing it with a graph.

    `params` maps the block's local parameter names to tensors used in their place (None: the
    block's own); `weights` are the tensors among them to differentiate (leaves)."""

    def forward(self, block: torch.nn.Module, params, args, kwargs):
        return block(*args, **kwargs) if params is None else torch.func.functional_call(block, params, args, kwargs)

    def grads(self, block, params, args, kwargs, grad_outputs, weights: list) -> tuple[list, list]:
        """(gradients of the flat inputs `tree_flatten((args, kwargs))` that require grad, None
        elsewhere; gradients of `weights`)."""
        with torch.enable_grad():
            out = self.forward(block, params, args, kwargs)
        return input_and_weight_grads((weights, tree_flatten((args, kwargs))[0], out), grad_outputs)

    def close(self) -> None:
        """The engine closes (a runner with hooks on the model removes them)."""


class KeptCheckpoints:
    """Block-boundary checkpoints kept where they are (device memory), as autograd would keep them."""

    def put(self, ctx, tensors: list) -> None:
        ctx.save_for_backward(*[t if torch.is_tensor(t) else None for t in tensors])
        ctx.others = [None if torch.is_tensor(t) else t for t in tensors]

    def take(self, ctx) -> list:
        return [s if o is None else o for s, o in zip(ctx.saved_tensors, ctx.others)]

    def begin_step(self) -> None:
        """A step starts (a store with a disk reserves it here, before any work)."""

    def begin_backward(self) -> None:
        """The forward pass is over (a store with a disk starts reading ahead)."""

    def end_step(self) -> None:
        """The step is over, or failed (a store drops what it still holds)."""

    def close(self) -> None:
        """The engine closes."""


def block_leaves(engine, index: int, weights: torch.Tensor, tensors: list) -> tuple[dict, list, list]:
    """(params: local name -> tensor, the trainable leaves among them, inputs: `tensors` as fresh
    leaves where they require grad) for a graph of block `index` on the flat `weights`.

    One leaf per trainable parameter: a single flat leaf would make autograd build a zero-filled
    flat-sized gradient for every view of it, then add them all up. Frozen parameters are plain views."""
    group = engine.state.blocks[index]
    views = group.layout.views(weights)
    leaves = [view.detach().requires_grad_() for view in views[:len(group.trainable)]]
    inputs = [t.detach().requires_grad_(t.requires_grad) if torch.is_tensor(t) else t for t in tensors]
    return dict(zip(group.local_names, leaves + views[len(group.trainable):])), leaves, inputs


def forward_with_graph(engine, index: int, weights: torch.Tensor, tensors: list, spec):
    """Run block `index` on the flat `weights` with a graph: (outputs, (leaves, inputs, outputs))."""
    params, leaves, inputs = block_leaves(engine, index, weights, tensors)
    with torch.enable_grad():
        args, kwargs = tree_unflatten(inputs, spec)
        out = engine.call_block(index, params, args, kwargs)
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
    """The `STREAM` hook of block `index`: routes its calls through the engine."""

    def __init__(self, engine, index: int):
        self.engine, self.index = engine, index

    def __call__(self, block, call_next, *args, **kwargs):
        # `call_next` is not called here: the engine runs the block itself on streamed weights, and
        # those calls reach the block's own forward below this hook (the registry's re-entry rule).
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
        ctx.context = contextvars.copy_context()  # the recompute sees what the forward saw (a parallel call's record)
        engine.checkpoints.put(ctx, list(tensors))
        return tuple(o.detach() if torch.is_tensor(o) else o for o in outs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        tensors = ctx.engine.checkpoints.take(ctx)
        engine = ctx.engine
        with torch.autocast(engine.device.type, dtype=engine.policy.compute_dtype, enabled=ctx.autocast):
            grads = ctx.context.run(engine.block_backward, ctx.index, tensors, ctx.spec, ctx.graph, grad_outputs)
        ctx.graph = None
        return (None, None, None, None, *grads)


def install_hooks(engine) -> None:
    hooks.refuse_hooks(engine.model, refused(engine.dp is not None))
    for index, block in enumerate(engine.blocks):
        hooks.add_hook(block, STREAM, BlockHook(engine, index))


def remove_hooks(engine) -> None:
    for block in engine.blocks:
        if isinstance(hooks.get_hook(block, STREAM), BlockHook):
            hooks.remove_hook(block, STREAM)
