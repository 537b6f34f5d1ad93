"""PolicyTrainer actors on real Monarch procs (CPU, gloo, FSDP2): a 2-rank step equals a 1-rank
step however the batch is split and for every model family, and resuming from a checkpoint on a
new mesh is bitwise exact."""

import asyncio
import shutil

import pytest
import torch
from monarch.actor import ActorError, this_host
from support.trainer_inputs import cat, rows

from rlactors.actors.trainer import spawn_trainer
from rlactors.config import LossConfig, ModelConfig, TrainerConfig
from rlactors.models.checkpoint import TOKENIZER_FILES, copy_tokenizer_files, from_pretrained
from rlactors.on_policy.sides import sides
from rlactors.procs.placement import free_port
from rlactors.trainer.batch import MicroBatch
from rlactors.trainer.checkpoint import latest_checkpoint
from rlactors.trainer.core import MICROBATCH_FIELDS
from rlactors.trainer.losses import LossNorm, compute_loss
from rlactors.weight_sync.broadcast import BufferReceiver
from rlactors.weight_sync.packed import PackedLayout

LOSS = LossConfig(name="dapo", clip_high=0.28)


async def spawn(ckpt, ranks, reference=False):
    config = TrainerConfig(ranks=ranks, lr=1e-2, max_grad_norm=0.005, warmup_steps=0)
    procs, trainer, _ = await spawn_trainer(this_host(), ModelConfig(path=str(ckpt)), config,
                                            sides(False, "native", "cpu").trainer, device="cpu", reference=reference)
    return procs, trainer


async def train_step(trainer, per_rank, norm, loss=LOSS):
    """per_rank[r] is rank r's list of microbatches (equal lengths): one forward_backward each, then a step."""
    for microbatches in zip(*per_rank):
        await trainer.forward_backward.call(list(microbatches), norm, loss)
    metrics = list((await trainer.optim_step.call()).values())
    assert all(m == metrics[0] for m in metrics)  # the step's stats are reduced over ranks
    return metrics[0]


async def policy(trainer):
    synced = await trainer.state_dict_for_sync.call("float32")
    assert all(synced.item(gpus=r) is None for r in range(1, len(synced)))  # only rank 0 returns them
    return synced.item(gpus=0)


def assert_close(a, b, atol):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=name)


@pytest.fixture(scope="module")
def loop():
    """One event loop for the module, so the tests can share a trainer mesh."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def two_ranks(loop, tiny_ckpt):
    procs, trainer = loop.run_until_complete(spawn(tiny_ckpt, 2, reference=True))
    yield trainer
    loop.run_until_complete(procs.stop())


def test_two_ranks_match_one_rank_however_the_batch_is_split(loop, two_ranks, tiny_ckpt):
    batch = rows(0)
    assert len(batch) == 8
    norm = LossNorm.for_step(batch, LOSS.name)

    async def one_rank():
        procs, trainer = await spawn(tiny_ckpt, 1)
        try:
            start = await policy(trainer)
            return start, await train_step(trainer, [[cat(batch)]], norm), await policy(trainer)
        finally:
            await procs.stop()

    async def two_ranks_split(split):
        assert (await two_ranks.load_checkpoint.call(str(tiny_ckpt))).item(gpus=0) == {"step": 0, "policy_version": 0}
        return await train_step(two_ranks, split, norm), await policy(two_ranks)

    start, one, one_weights = loop.run_until_complete(one_rank())
    # a visible update
    assert max((one_weights.weights[n] - w).abs().max().item() for n, w in start.weights.items()) > 1e-3
    for split in ([[cat(batch[:4])], [cat(batch[4:])]],
                  [[cat(batch[:1]), cat(batch[1:3])], [cat(batch[3:7]), cat(batch[7:])]]):
        metrics, weights = loop.run_until_complete(two_ranks_split(split))
        assert weights.version == one_weights.version == 1
        assert_close(weights.weights, one_weights.weights, atol=1e-5)
        assert metrics["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
        assert metrics["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
        assert metrics["tokens"] == one["tokens"] == norm.num_tokens
        assert metrics["logprob_diff/max"] == pytest.approx(one["logprob_diff/max"], rel=1e-5)


def test_a_sequence_loss_with_the_reference_kl_over_two_ranks_matches_plain_pytorch(loop, two_ranks, tiny_ckpt):
    """GSPO with a sequence-level mask and the KL to the reference that the ranks hold sharded, after
    a first step moved the policy: the step's loss and stats (ratio quantiles summed over the ranks'
    histograms) are those of the whole batch on one unsharded model against the initial one."""
    loss = LossConfig(name="gspo", is_mask_high=2.0, is_mask_level="sequence", kl_coef=0.5)
    first, batch = rows(2), rows(3)
    # Near the tiny model's own logprobs (about -log 1024), so that some sequences' ratios leave [0, 2]
    g = torch.Generator().manual_seed(0)
    batch = [MicroBatch(**{**vars(mb), "generator_logprobs": torch.where(
        mb.loss_mask, -9 + 3 * torch.rand(mb.loss_mask.shape, generator=g), 0.0)}) for mb in batch]

    async def steps():
        await two_ranks.load_checkpoint.call(str(tiny_ckpt))
        await train_step(two_ranks, [[cat(first[:4])], [cat(first[4:])]], LossNorm.for_step(first, LOSS.name))
        moved = await policy(two_ranks)
        norm = LossNorm.for_step(batch, loss.name)
        return moved, await train_step(two_ranks, [[cat(batch[:5])], [cat(batch[5:])]], norm, loss)

    moved, metrics = loop.run_until_complete(steps())
    model, initial = from_pretrained(tiny_ckpt, dtype=torch.float32), from_pretrained(tiny_ckpt, dtype=torch.float32)
    model.load_state_dict(moved.weights, strict=False)
    flat = {name: getattr(cat(batch), name).reshape(-1) for name in MICROBATCH_FIELDS}
    with torch.no_grad():
        logprobs, reference = (m.token_logprobs(m.forward_packed(flat["input_ids"], flat["positions"]),
                                                flat["target_ids"]) for m in (model, initial))
    _, stats = compute_loss(loss, LossNorm.for_step(batch, loss.name), logprobs, flat["loss_mask"], flat["advantages"],
                            flat["generator_logprobs"], positions=flat["positions"], reference_logprobs=reference)
    expected = stats.metrics()
    assert 0 < expected["is_masked/share"] < 1 and expected["kl/mean"] > 0
    for key in ("loss", "kl/mean", "is_masked/share", "is_ratio/p5", "is_ratio/p50", "is_ratio/p95",
                "is_seq_ratio/p50", "is_seq_ratio/max", "clip_fraction", "tokens"):
        assert metrics[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-7), key


@pytest.mark.parametrize("family, tie", [("qwen2", False), ("llama", True), ("qwen3_moe", False)])
def test_two_ranks_match_one_rank_for_each_family(loop, family_ckpt, family, tie):
    ckpt, batch = family_ckpt(family, tie), rows(5)
    norm = LossNorm.for_step(batch, LOSS.name)

    async def trained(ranks, split):
        procs, trainer = await spawn(ckpt, ranks)
        try:
            start = await policy(trainer)
            return start, await train_step(trainer, split, norm), await policy(trainer)
        finally:
            await procs.stop()

    start, one, one_weights = loop.run_until_complete(trained(1, [[cat(batch)]]))
    _, two, two_weights = loop.run_until_complete(trained(2, [[cat(batch[:3])], [cat(batch[3:])]]))
    assert max((one_weights.weights[n] - w).abs().max().item() for n, w in start.weights.items()) > 1e-3
    assert_close(two_weights.weights, one_weights.weights, atol=1e-5)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)


def test_resume_on_a_new_mesh_is_bitwise_identical_and_bad_input_changes_nothing(loop, two_ranks, tiny_ckpt, tmp_path):
    batches = [rows(seed) for seed in (1, 2)]
    norms = [LossNorm.for_step(b, LOSS.name) for b in batches]

    def split(batch):
        return [[cat(batch[:3])], [cat(batch[3:])]]

    async def uninterrupted():
        await two_ranks.load_checkpoint.call(str(tiny_ckpt))
        await train_step(two_ranks, split(batches[0]), norms[0])
        path = (await two_ranks.save_checkpoint.call(str(tmp_path), 1)).item(gpus=0)
        return path, await train_step(two_ranks, split(batches[1]), norms[1]), await policy(two_ranks)

    async def resumed(path):
        procs, trainer = await spawn(tiny_ckpt, 2)
        try:
            assert (await trainer.load_checkpoint.call(path)).item(gpus=1) == {"step": 1, "policy_version": 1}
            bad = cat(batches[1][3:])
            bad.target_ids[0, 5] = 5000  # out of vocabulary, on rank 1's microbatch only
            with pytest.raises(ActorError, match="outside the vocabulary"):
                await trainer.forward_backward.call([cat(batches[1][:3]), bad], norms[1], LOSS)
            return await train_step(trainer, split(batches[1]), norms[1]), await policy(trainer)
        finally:
            await procs.stop()

    path, expected_metrics, expected = loop.run_until_complete(uninterrupted())
    assert str(latest_checkpoint(tmp_path)) == path
    metrics, actual = loop.run_until_complete(resumed(path))
    assert metrics == expected_metrics and metrics["policy_version"] == 2
    assert actual.version == expected.version == 2
    for name in expected.weights:
        assert torch.equal(actual.weights[name], expected.weights[name]), name


def test_each_rank_loads_only_its_rows_of_a_sharded_hf_checkpoint(loop, tiny_ckpt_untied, tmp_path):
    """3 ranks (dim 0 of the 1024-row embedding and head splits 342/342/340) load a bf16 checkpoint
    written in several safetensors shards: the gathered fp32 weights are exactly the file's."""
    from rlactors.models.checkpoint import from_pretrained, load_args, save_pretrained

    reference = from_pretrained(tiny_ckpt_untied, dtype=torch.bfloat16)
    sharded = tmp_path / "sharded_bf16"
    save_pretrained(reference, load_args(tiny_ckpt_untied), sharded, max_shard_bytes=200_000)
    assert len(list(sharded.glob("model-*.safetensors"))) > 1

    async def loaded():
        procs, trainer = await spawn(sharded, 3)
        try:
            return (await policy(trainer)).weights
        finally:
            await procs.stop()

    weights = loop.run_until_complete(loaded())
    expected = {name: tensor.float() for name, tensor in reference.state_dict().items()}
    assert weights.keys() == expected.keys() and "lm_head.weight" in weights
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


def test_a_save_that_fails_on_rank_0_fails_on_every_rank_and_leaves_no_partial_dir(loop, tiny_ckpt, tmp_path):
    """Rank 0 alone writes the HF export: its failure (here model.path lost its tokenizer files
    after the start) must reach the other ranks instead of leaving them at a barrier."""
    ckpt = tmp_path / "model"
    shutil.copytree(tiny_ckpt, ckpt)

    async def save_without_tokenizer():
        procs, trainer = await spawn(ckpt, 2)
        try:
            for name in TOKENIZER_FILES:
                (ckpt / name).unlink(missing_ok=True)
            with pytest.raises(ActorError) as failed:  # before the fix, rank 1 waited at a barrier for good
                await asyncio.wait_for(trainer.save_checkpoint.call(str(tmp_path / "ckpts"), 2), 120)
            left = sorted(p.name for p in (tmp_path / "ckpts").iterdir())
            # No rank is stuck: with the files back, the same mesh saves the step.
            copy_tokenizer_files(tiny_ckpt, ckpt)
            saved = (await asyncio.wait_for(trainer.save_checkpoint.call(str(tmp_path / "ckpts"), 2), 120)).item(gpus=1)
            return str(failed.value), left, saved
        finally:
            await procs.stop()

    error, left, saved = loop.run_until_complete(save_without_tokenizer())
    assert f"ValueError: {ckpt} holds no tokenizer files" in error
    assert left == []  # no .step_00000002.partial
    assert saved == str(latest_checkpoint(tmp_path / "ckpts")) == str(tmp_path / "ckpts" / "step_00000002")


def test_two_ranks_send_the_policy_in_chunks_cut_across_their_shards_bit_for_bit(loop, two_ranks, tiny_ckpt):
    """The weight broadcast's sending side over FSDP2 on 2 ranks: each chunk gathered from both
    ranks' rows (the embedding's chunks cut across the boundary of its two shards) and sent, then
    the trailer; a receiver gets the policy bit for bit, verified, at the trainer's version, and
    again after an optimizer step (the ranks plan their gathers once, when the group forms)."""
    async def send(version):
        sent, _ = await asyncio.gather(two_ranks.send_weights.call(version),
                                       asyncio.to_thread(receiver.receive, version))
        assert sent.item(gpus=1) is None and sent.item(gpus=0)["version"] == version
        assert sent.item(gpus=0)["checksum"] == chunked.checksum(receiver.buffer)
        expected = (await two_ranks.state_dict_for_sync.call("bfloat16")).item(gpus=0).weights
        return expected, {name: t.clone() for name, t in receiver.weights().items()}

    async def main():
        await two_ranks.load_checkpoint.call(str(tiny_ckpt))
        await asyncio.gather(two_ranks.init_weight_sender.call("127.0.0.1", port, 2, chunked),
                             asyncio.to_thread(receiver.join, "127.0.0.1", port, 1, 2))
        first = await send(0)
        batch = rows(0)
        await train_step(two_ranks, [[cat(batch[:4])], [cat(batch[4:])]], LossNorm.for_step(batch, LOSS.name))
        return first, await send(1)

    layout = loop.run_until_complete(two_ranks.weight_layout.call("bfloat16")).item(gpus=0)
    chunked = PackedLayout.of([(s.name, torch.empty(s.shape, dtype=s.torch_dtype, device="meta"))
                               for s in layout.specs], chunk_bytes=96 << 10)
    receiver, port = BufferReceiver(chunked, torch.device("cpu")), free_port()
    sends = loop.run_until_complete(main())
    embed = [(p.first_row, p.rows) for c in chunked.chunks for p in c.pieces if p.name == "model.embed_tokens.weight"]
    assert embed == [(0, 384), (384, 384), (768, 256)]  # rows 384-767 come from both ranks' shards
    for expected, received in sends:
        assert received.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(received[name], tensor) and received[name].dtype == torch.bfloat16, name
    (before, _), (after, _) = sends
    assert not all(torch.equal(before[name], after[name]) for name in before)  # the step changed the policy
