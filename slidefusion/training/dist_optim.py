"""The optimizer seam (`train_step(loss_fn)`, state dicts) on several ranks, resident, and the
sequence-parallel hooks a training model gets.

  DataParallelOptimizer  every rank holds the whole model and AdamW state; after backward the
                         gradients are all-reduced in one flat buffer and divided by the data-parallel
                         ranks (sequence-parallel ranks each hold part of a sample's gradient: they add up)
  FsdpOptimizer          FSDP2: `fully_shard` on every block (from the model's adapter) and on the
                         model, with a mixed precision policy (bf16 parameters and fp32 reductions on a
                         GPU) and optionally FSDP2's CPUOffloadPolicy; its state dicts are the whole
                         model's, in the torch AdamW layout one process uses, so a run resumes on any
                         number of ranks, resident or offloaded
  sequence_parallel      the Ulysses inference hooks (`parallel.parallelize`) on the training model: its
                         exchanges are differentiable (`parallel.exchange`), so backward runs through them
The offload engine shards its own state (`offload.engine.sharded`, `OffloadEngine(..., ranks=)`).
"""

import torch
import torch.distributed as dist
from torch import nn

from slidefusion.core.errors import UserError
from slidefusion.training.task import ResidentOptimizer


class DataParallelOptimizer(ResidentOptimizer):
    """`ResidentOptimizer` with the gradients reduced over the ranks before clipping and the step."""

    def __init__(self, model: nn.Module, optim, data_ranks: int):
        super().__init__(model, optim)
        self.data_ranks = data_ranks
        self.trained = [p for p in model.parameters() if p.requires_grad]

    def train_step(self, loss_fn) -> float:
        """One step; a list of loss functions (micro-batches, each scaled by its share) adds up its
        gradients locally, and the one all-reduce follows the last backward."""
        self.optimizer.zero_grad(set_to_none=True)
        value = _backward_all(self.model, loss_fn)
        self._reduce()
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        return value

    def _reduce(self) -> None:
        """Sum every gradient over the world (one flat all-reduce), then divide by the data-parallel ranks."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.trained]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat.div_(self.data_ranks)
        for param, grad in zip(self.trained, flat.split([g.numel() for g in grads])):
            param.grad = grad.view_as(param)


class FsdpOptimizer:
    """FSDP2 on the model, AdamW on its shards. The model is sharded at first use (a step, or a
    state load), so weights written into it before (resume, --init-from) are the plain tensors."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], optim, data_ranks: int, cpu_offload: bool,
                 device: torch.device):
        self.model, self.blocks, self.optim, self.device = model, blocks, optim, device
        self.data_ranks, self.cpu_offload, self.optimizer, self.lr = data_ranks, cpu_offload, None, optim.lr
        self.max_grad_norm = optim.max_grad_norm

    def _shard(self) -> None:
        if self.optimizer is not None:
            return
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if self.device.type == "cuda" else None,
                                         reduce_dtype=torch.float32)
        options = dict(mesh=mesh, mp_policy=precision, offload_policy=CPUOffloadPolicy() if self.cpu_offload
                       else OffloadPolicy())
        for block in self.blocks:
            fully_shard(block, **options)
        fully_shard(self.model, **options)
        self.model.set_gradient_divide_factor(float(self.data_ranks))  # sum over sequence ranks, mean over data
        fused = self.device.type == "cuda" and not self.cpu_offload
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr, betas=self.optim.betas,
                                           eps=self.optim.eps, weight_decay=self.optim.weight_decay, fused=fused or None)

    def set_lr(self, lr: float) -> None:
        self.lr = lr
        for group in self.optimizer.param_groups if self.optimizer is not None else ():
            group["lr"] = lr

    def train_step(self, loss_fn) -> float:
        self._shard()
        self.set_lr(self.lr)
        self.optimizer.zero_grad(set_to_none=True)
        value = _backward_all(self.model, loss_fn)  # FSDP2 adds each micro-batch's reduced shards up
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        return value

    def model_state_dict(self) -> dict:
        """The whole model's weights on every rank (on the CPU); every rank must call it."""
        if self.optimizer is None:
            return self.model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        whole = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        return {k: v.detach().cpu() for k, v in whole.items()}

    def first_nonfinite(self) -> str | None:
        return next((k for k, v in self.model_state_dict().items() if v.is_floating_point()
                     and not torch.isfinite(v).all()), None)

    def load_model_weights(self, weights: dict, strict: bool = True) -> None:
        if self.optimizer is None:
            self.model.load_state_dict(weights, strict=strict)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.model, weights, options=StateDictOptions(full_state_dict=True, strict=strict))

    def state_dict(self) -> dict:
        """torch AdamW's `state_dict()` of the whole model as one process keeps it (parameter indices)."""
        self._shard()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        whole = get_optimizer_state_dict(self.model, self.optimizer, options=StateDictOptions(full_state_dict=True))
        index = {name: i for i, (name, _) in enumerate(self.model.named_parameters())}
        state = {index[name]: {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in values.items()}
                 for name, values in whole["state"].items()}
        groups = [dict(group, params=[index[name] for name in group["params"]]) for group in whole["param_groups"]]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state: dict) -> None:
        self._shard()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        names = [name for name, _ in self.model.named_parameters()]
        try:
            whole = {"state": {names[i]: values for i, values in state["state"].items()},
                     "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in state["param_groups"]]}
        except (KeyError, IndexError, TypeError) as error:
            raise UserError(f"the saved optimizer state does not fit this model ({error!r})") from None
        set_optimizer_state_dict(self.model, self.optimizer, whole, options=StateDictOptions(full_state_dict=True))
        self.lr = float(state["param_groups"][0]["lr"])


def resident_optimizer(model: nn.Module, config, ranks):
    """The resident optimizer of a run: one process, plain data parallel, or FSDP2 (`parallel.fsdp`)."""
    if ranks is None or not ranks.active:
        return ResidentOptimizer(model, config.optim)
    if config.parallel.fsdp:
        from slidefusion.families import adapter_for

        return FsdpOptimizer(model, adapter_for(model).blocks(model), config.optim, ranks.place.dp,
                             config.parallel.cpu_offload, ranks.device)
    return DataParallelOptimizer(model, config.optim, ranks.place.dp)


def sequence_parallel(model: nn.Module, ranks) -> None:
    """Attach the Ulysses hooks over this rank's sequence group (nothing with `parallel.sp=1`).
    Call it before the offload engine's hooks: the engine then runs the hooked blocks."""
    if ranks is None or ranks.place.sp == 1:
        return
    from slidefusion.parallel import ParallelConfig, parallelize

    try:
        parallelize(model, ParallelConfig("ulysses", 1, timeout_s=ranks.config.parallel.timeout_s), group=ranks.sp_group())
    except UserError as error:
        raise UserError(f"parallel.sp={ranks.place.sp}: {error}") from None


def check_sequence_parallel(model: nn.Module, sp: int) -> None:
    """Refuse `parallel.sp` beyond what Ulysses can split this model over (its heads), before any work."""
    if sp == 1:
        return
    from slidefusion.parallel.plan import SCHEDULES, plan_for

    try:
        plan_for(model, SCHEDULES["ulysses"], ranks=sp)
    except UserError as error:
        raise UserError(f"parallel.sp={sp}: {error}") from None


def _backward_all(model: nn.Module, loss_fn) -> float:
    """Forward and backward of one loss function or of a list of them (micro-batches); their summed loss."""
    value = 0.0
    for fn in loss_fn if isinstance(loss_fn, (list, tuple)) else [loss_fn]:
        loss = fn(model)
        loss.backward()
        value += loss.item()
    return value
