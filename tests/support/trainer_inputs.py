"""Helpers shared by the trainer tests: synthetic microbatches and a one-rank process group."""

import contextlib
import math
import socket

import pytest
import torch
import torch.distributed as dist

from rlactors.trainer.batch import MicroBatch
from rlactors.trainer.core import MICROBATCH_FIELDS
from rlactors.trainer.parallel import init_distributed


def rows(seed, count=8, row_tokens=48, vocab=1024):
    """`count` one-row microbatches: documents end to end, then a padding document; positions
    restart per document, loss tokens after a 3-token prompt, every 7th generator logprob NaN."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        lengths = []
        while sum(lengths) < row_tokens - 8:
            lengths.append(min(int(torch.randint(6, 24, (1,), generator=g)), row_tokens - sum(lengths)))
        pad = row_tokens - sum(lengths)
        positions = torch.cat([torch.arange(n) for n in lengths + [pad] if n])[None]
        loss_mask = positions >= 3
        if pad:
            loss_mask[0, -pad:] = False
        logprobs = -3 * torch.rand(1, row_tokens, generator=g)
        logprobs[0, ::7] = math.nan
        out.append(MicroBatch(
            input_ids=torch.randint(vocab, (1, row_tokens), generator=g), positions=positions,
            target_ids=torch.randint(vocab, (1, row_tokens), generator=g), loss_mask=loss_mask,
            advantages=torch.where(loss_mask, torch.randn(1, row_tokens, generator=g), 0.0),
            generator_logprobs=torch.where(loss_mask, logprobs, 0.0),
            versions=torch.where(loss_mask, 0, -1)))
    return out


def cat(mbs):
    names = MICROBATCH_FIELDS + (("routed_experts",) if mbs[0].routed_experts is not None else ())
    return MicroBatch(**{name: torch.cat([getattr(mb, name) for mb in mbs]) for name in names})


@contextlib.contextmanager
def one_rank_process_group(device_type: str):
    """A one-rank process group for the trainer core in this test process (gloo; with CUDA, NCCL for
    CUDA tensors); yields this rank's device."""
    if dist.is_initialized():
        assert dist.get_world_size() == 1
        yield init_distributed(device_type)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(port)}.items():
            mp.setenv(key, value)
        yield init_distributed(device_type)
    dist.destroy_process_group()
