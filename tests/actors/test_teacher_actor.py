"""The distillation teacher on a Monarch proc of its own (CPU): it scores the student's sampled
tokens as the plain model does, a dead teacher proc fails the call at once naming it, and a
teacher without the student's tokenizer is refused before it loads."""

import asyncio
import json
import logging
import os
import shutil
import signal

import monarch.actor
import pytest
import torch
from monarch.actor import this_host
from support.trainer_inputs import cat, rows

from rlactors.actors.teacher import score, spawn_teacher
from rlactors.actors.trainer import forward_backward
from rlactors.config import ConfigError, ModelConfig, TeacherConfig, TrainerConfig
from rlactors.models.checkpoint import from_pretrained
from rlactors.on_policy.sides import sides
from rlactors.procs.liveness import ProcLost, ProcWatcher
from rlactors.procs.liveness_actor import watch_procs
from rlactors.trainer.teacher import check_teacher_tokenizer


def test_the_teacher_proc_scores_the_sampled_tokens_and_its_death_fails_the_call_naming_it(tiny_ckpt,
                                                                                         tiny_ckpt_untied):
    # As a run's controller does: the killed proc's faults are logged rather than ending this
    # process. Not restored: they may come after the test (one per actor on the proc).
    monarch.actor.unhandled_fault_hook = lambda failure: logging.getLogger(__name__).error("fault: %s", failure)
    batches = [cat(rows(0, count=2)), cat(rows(1, count=3))]
    plain = from_pretrained(tiny_ckpt_untied).requires_grad_(False)
    expected = [plain.token_logprobs(plain.forward_packed(mb.input_ids.reshape(-1), mb.positions.reshape(-1)),
                                     mb.target_ids.reshape(-1)).reshape(mb.input_ids.shape) for mb in batches]

    async def main():
        watcher = ProcWatcher(unresponsive_timeout_s=60.0)
        procs, teacher = await spawn_teacher(this_host(), TeacherConfig(path=str(tiny_ckpt_untied)),
                                             ModelConfig(path=str(tiny_ckpt)), TrainerConfig(ranks=1),
                                             sides(False, "native", "cpu").trainer)
        try:
            watched = await watch_procs(watcher, procs, ["teacher rank 0"])
            guarded = watcher.guard(teacher, watched)
            scored = await score(guarded, batches)
            os.kill(watched[0].pid, signal.SIGKILL)
            with pytest.raises(ProcLost) as lost:
                await asyncio.wait_for(score(guarded, batches), 60)
            return scored, str(lost.value), watched[0].pid
        finally:
            watcher.close()
            await procs.stop()

    scored, lost, pid = asyncio.run(main())
    for mb, got, want in zip(batches, scored, expected):
        assert torch.equal(got.input_ids, mb.input_ids) and got.teacher_logprobs.dtype == torch.float32
        torch.testing.assert_close(got.teacher_logprobs, want, rtol=0, atol=1e-5)
    assert lost == f"teacher rank 0 (pid {pid}) exited (signal 9)"


def test_a_teacher_needs_the_students_tokenizer(tiny_ckpt, tiny_ckpt_untied, tmp_path):
    assert check_teacher_tokenizer(str(tiny_ckpt_untied), str(tiny_ckpt)) == 1024
    with pytest.raises(ConfigError, match=r"^teacher.path: checkpoint directory not found: .*missing$"):
        check_teacher_tokenizer(str(tmp_path / "missing"), str(tiny_ckpt))
    other_vocab = tmp_path / "other_vocab"
    shutil.copytree(tiny_ckpt, other_vocab)
    config = json.loads((other_vocab / "config.json").read_text())
    (other_vocab / "config.json").write_text(json.dumps({**config, "vocab_size": 2048}))
    with pytest.raises(ConfigError, match=r"^teacher.path: .*other_vocab has 2048 tokens, the student 1024: a "
                                          r"teacher needs the student's tokenizer$"):
        check_teacher_tokenizer(str(other_vocab), str(tiny_ckpt))
    other_ids = tmp_path / "other_ids"
    shutil.copytree(tiny_ckpt, other_ids)
    tokenizer = json.loads((other_ids / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two tokens swap ids
    (other_ids / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ConfigError, match=r"^teacher.path: .*other_ids's tokenizer maps tokens to other ids than "
                                          r"the student's: a teacher needs the student's tokenizer$"):
        check_teacher_tokenizer(str(other_ids), str(tiny_ckpt))


class _Endpoint:
    def __init__(self, work):
        self.work = work

    def call(self, *args):
        return asyncio.ensure_future(self.work(*args))


class _Values:
    """A one-point answer of a whole-mesh call (what `first_value` reads)."""

    extent: dict = {}

    def __init__(self, value):
        self.value = value

    def item(self):
        return self.value


def test_each_calls_microbatches_reach_the_trainer_scored_and_a_failed_scoring_fails_the_step():
    """The trainer's call j is sent once the teacher scored call j's microbatches, before call j+1's
    are scored; a scoring that fails fails forward_backward with its error."""
    events = []

    async def score_mbs(mbs, fail_at=None):
        events.append(("score", mbs[0]))
        if mbs[0] == fail_at:
            raise RuntimeError(f"teacher failed on {fail_at}")
        return _Values([f"{mb}+teacher" for mb in mbs])

    async def train(mbs, norm, loss):
        await asyncio.sleep(0)
        return mbs

    def trainer_call(mbs, norm, loss):
        events.append(("train", mbs))
        return asyncio.ensure_future(train(mbs, norm, loss))

    trainer = type("Trainer", (), {"forward_backward": type("E", (), {"call": staticmethod(trainer_call)})()})()
    per_rank = [["a0", "a1", "a2"], ["b0", "b1", "b2"]]
    teacher = type("Teacher", (), {"score": _Endpoint(score_mbs)})()
    asyncio.run(forward_backward(trainer, per_rank, None, None, teacher))
    assert events == [("score", "a0"), ("train", ["a0+teacher", "b0+teacher"]),
                      ("score", "a1"), ("train", ["a1+teacher", "b1+teacher"]),
                      ("score", "a2"), ("train", ["a2+teacher", "b2+teacher"])]
    events.clear()
    failing = type("Teacher", (), {"score": _Endpoint(lambda mbs: score_mbs(mbs, fail_at="a1"))})()
    with pytest.raises(RuntimeError, match="^teacher failed on a1$"):
        asyncio.run(forward_backward(trainer, per_rank, None, None, failing))
    assert events == [("score", "a0"), ("train", ["a0+teacher", "b0+teacher"]), ("score", "a1")]
