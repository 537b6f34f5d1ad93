"""Optimizer state offload: AdamW's moments in host memory between steps, on the GPU only for the step.

`OffloadedStep` keeps each parameter's optimizer state (exp_avg, exp_avg_sq, step) in pinned host
memory (a DTensor's as its plain local shard) and runs the optimizer step one group of parameters
at a time (a decoder layer, or one of the others: embedding, LM head, final norm): the group's
state is copied to the device, the optimizer steps those parameters alone (the others' gradients
are held aside), and the updated state is copied back. The GPU holds one group's state at a time,
not the model's; the update is the optimizer's own, on the device, so the weights and state are
bitwise those of the plain step (AdamW's update of one parameter does not depend on the others').
The cost is a copy of the state each way per step, over PCIe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def layer_groups(model: nn.Module) -> list[list[nn.Parameter]]:
    """The trainable parameters of each decoder layer, then each of the others (embedding, LM
    head, final norm) on its own, in model order; with `model.lora`, a layer's adapters."""
    layers = [[p for p in layer.parameters() if p.requires_grad] for layer in model.model.layers]
    in_layers = {id(p) for group in layers for p in group}
    rest = [[p] for p in model.parameters() if p.requires_grad and id(p) not in in_layers]
    return [group for group in (*layers, *rest) if group]


def copy_to(tensor: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    """A copy of `tensor` on `device`, in pinned host memory where `pin` and the copy goes to the
    CPU, so that copies to and from a GPU run at full speed."""
    pin = pin and device.type == "cpu" and torch.cuda.is_available()
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, device=device, pin_memory=pin)
    copy.copy_(tensor)
    return copy


class OffloadedStep:
    """Steps `optimizer` over `groups` of its parameters, their state held on `host` between steps.

    `device` is where the parameters live and the step runs; `host` where the state waits (the
    CPU; tests may pass another device to see that it moves). On the host a DTensor's state waits
    as its plain local shard, the DTensor made again around it on the way back: a DTensor's
    `from_local` puts a shard on its mesh's device, so a host shard kept as a DTensor would be
    back on the GPU."""

    def __init__(self, optimizer: torch.optim.Optimizer, groups: Sequence[Sequence[nn.Parameter]],
                 device: torch.device, host: torch.device | None = None):
        self.optimizer, self.device, self.host = optimizer, device, host or torch.device("cpu")
        self.groups = [list(group) for group in groups]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grouped = [p for group in self.groups for p in group]
        if sorted(map(id, grouped)) != sorted(map(id, params)):
            raise ValueError("the offload groups must hold each of the optimizer's parameters exactly once")
        # per parameter, for each state value waiting on the host as a DTensor's local shard: the
        # DTensor's mesh, placements, global shape and stride
        self._shardings: dict[nn.Parameter, dict[str, tuple[Any, ...]]] = {}

    def step(self) -> None:
        """One optimizer step, a group at a time; each group's state is back on the host after."""
        grads = {p: p.grad for group in self.groups for p in group}
        try:
            for group in self.groups:
                members = {id(p) for p in group}
                for p in grads:
                    p.grad = grads[p] if id(p) in members else None
                self._to_device(group)
                self.optimizer.step()
                self._to_host(group)
        finally:
            for p, grad in grads.items():
                p.grad = grad

    def to_host(self) -> None:
        """Every parameter's state to the host (after a step or a load that left it on the device)."""
        for group in self.groups:
            self._to_host(group)

    def to_device(self) -> None:
        """Every parameter's state to the device (for a checkpoint's save or load)."""
        for group in self.groups:
            self._to_device(group)

    def _to_host(self, params: Sequence[nn.Parameter]) -> None:
        self._replace_state(params, self._on_host)

    def _to_device(self, params: Sequence[nn.Parameter]) -> None:
        self._replace_state(params, self._on_device)

    def _replace_state(self, params: Sequence[nn.Parameter], moved: Callable[[nn.Parameter, str, Any], Any]) -> None:
        state = self.optimizer.state
        for p in params:
            if p in state:
                state[p] = {key: moved(p, key, value) for key, value in state[p].items()}

    def _on_host(self, p: nn.Parameter, key: str, value: Any) -> Any:
        if isinstance(value, DTensor):
            self._shardings.setdefault(p, {})[key] = (value.device_mesh, value.placements, value.shape,
                                                      value.stride())
            value = value.to_local()
        if isinstance(value, torch.Tensor) and not _on(value, self.host):
            value = copy_to(value, self.host, pin=True)
        return value

    def _on_device(self, p: nn.Parameter, key: str, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and not _on(value, self.device):
            value = copy_to(value, self.device, pin=False)
        sharding = self._shardings.get(p, {}).pop(key, None)
        if sharding is None:
            return value
        mesh, placements, shape, stride = sharding
        return DTensor.from_local(value, mesh, placements, run_check=False, shape=shape, stride=stride)


def _on(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether `tensor` is on `device` (one without an index: any of its type)."""
    return tensor.device.type == device.type and device.index in (None, tensor.device.index)
