"""The optimizer state's mover (rlactors.trainer.offload): copies that restore the state bitwise,
every state tensor moved, and groups that must cover the optimizer's parameters."""

import pytest
import torch
from torch import nn

from rlactors.config import LoraConfig
from rlactors.lora.adapters import adapter_parameters, to_lora
from rlactors.models.decoder import DecoderForCausalLM
from rlactors.models.tiny import size_args
from rlactors.trainer.offload import OffloadedStep, copy_to, layer_groups


def stepped_adamw(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(2):
        model(torch.randn(3, 8)).square().sum().backward()
        optimizer.step()
    return model, optimizer


def test_a_round_trip_restores_the_state_bitwise_in_new_memory():
    _, optimizer = stepped_adamw()
    for state in optimizer.state.values():
        for key, value in state.items():
            there = copy_to(value, torch.device("cpu"), pin=True)
            back = copy_to(there, torch.device("cpu"), pin=True)
            assert torch.equal(back, value) and back.dtype == value.dtype, key
            assert there.data_ptr() != value.data_ptr() and back.data_ptr() != there.data_ptr()


def test_every_state_tensor_moves_to_the_host_and_to_the_device():
    """The meta device stands for the other end of each move: a state tensor left behind would
    still be on the CPU."""
    meta, cpu = torch.device("meta"), torch.device("cpu")
    for device, host, move in ((cpu, meta, OffloadedStep.to_host), (meta, cpu, OffloadedStep.to_device)):
        model, optimizer = stepped_adamw()
        shapes = {p: {k: (v.shape, v.dtype) for k, v in s.items()} for p, s in optimizer.state.items()}
        move(OffloadedStep(optimizer, [list(m.parameters()) for m in model], device, host=host))
        assert len(optimizer.state) == 4
        for p, state in optimizer.state.items():
            assert {k: (v.device.type, v.shape, v.dtype) for k, v in state.items()} == \
                {k: ("meta", *shape) for k, shape in shapes[p].items()}


def test_groups_must_hold_each_parameter_once():
    model, optimizer = stepped_adamw()
    params = list(model.parameters())
    for groups in ([params[:2]], [params, params[:1]]):
        with pytest.raises(ValueError, match="must hold each of the optimizer's parameters exactly once"):
            OffloadedStep(optimizer, groups, torch.device("cpu"))


def test_under_lora_the_groups_are_each_layers_adapters():
    model = DecoderForCausalLM(size_args("tiny", 100))
    to_lora(model, LoraConfig(rank=2), torch.float32)
    groups = layer_groups(model)
    adapters = adapter_parameters(model)
    assert [{id(p) for p in group} for group in groups] == [
        {id(p) for name, p in adapters.items() if name.startswith(f"model.layers.{i}.")}
        for i in range(len(model.model.layers))]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    OffloadedStep(optimizer, groups, torch.device("cpu"))  # the frozen base is in no group
