"""Checkpoints written by the real save code (PolicyTrainerCore on one gloo rank, no Monarch):
every file is covered by the manifest, damage to any one of them is named and passed over for the
intact checkpoint before it, and a disk that fails mid-save leaves no partial dir."""

import errno
import json

import pytest
import torch
from support.trainer_inputs import cat, one_rank_process_group, rows
from support.true_on_policy import make_core

from rlactors.config import LossConfig, load_config
from rlactors.run.run_dir import ResumeState, RunDir
from rlactors.storage.manifest import MANIFEST_FILE, verify
from rlactors.trainer.checkpoint import COMPLETE_FILE, HF_DIR, checkpoint_dir, newest_intact, prune
from rlactors.trainer.losses import LossNorm


@pytest.fixture(scope="module")
def device():
    with one_rank_process_group("cpu"):
        yield torch.device("cpu")


@pytest.fixture(scope="module")
def core(tiny_ckpt, device):
    return make_core(tiny_ckpt, device, true_on_policy=False)


def step(core, seed):
    mb = cat(rows(seed))
    core.forward_backward([mb], LossNorm.for_step([mb], "grpo"), LossConfig())
    core.optim_step()


@pytest.fixture(scope="module")
def saved(core, tmp_path_factory):
    """A run dir whose checkpoints of steps 1 and 2 were written by the trainer's save, with the
    controller's state inside, and metrics.jsonl recording both steps."""
    run = tmp_path_factory.mktemp("run")
    for s in (1, 2):
        step(core, 20 + s)
        state = ResumeState(s, core.version, samples={}, rollouter={})
        core.save_checkpoint(run / "checkpoints", s, state.files())
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "rollout/reward_mean": 0.5}) + "\n"
                                               for s in (1, 2)))
    return run


def _config(run_dir):
    return load_config(overrides=['model.path="/not/read"', "controller.steps=5", f'controller.run_dir="{run_dir}"'])


def files_of(path):
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())


def test_the_manifest_lists_every_file_but_itself_and_complete(saved):
    path = checkpoint_dir(saved / "checkpoints", 2)
    listed = json.loads((path / MANIFEST_FILE).read_text())["files"]
    assert sorted(listed) == [f for f in files_of(path) if f not in (MANIFEST_FILE, COMPLETE_FILE)]
    assert {f"{HF_DIR}/model.safetensors", f"{HF_DIR}/{MANIFEST_FILE}", "trainer_state.json",
            "controller_state.json", "dcp/.metadata"} <= set(listed)
    assert all(entry["bytes"] == (path / name).stat().st_size for name, entry in listed.items())
    assert verify(path) is None and verify(path / HF_DIR) is None


def _damages(path):
    """(file, what, damage, undo) for each way of damaging each file of checkpoint `path`: a
    flipped byte, a truncation to half, the file removed."""
    for name in files_of(path):
        if name == COMPLETE_FILE:  # empty: its absence is what marks an unfinished save
            continue
        file = path / name
        data = file.read_bytes()
        assert data, name
        middle = len(data) // 2
        flipped = data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1:]
        for what, damaged in (("flipped", flipped), ("truncated", data[:middle])):
            yield name, what, lambda f=file, d=damaged: f.write_bytes(d), lambda f=file, d=data: f.write_bytes(d)
        yield name, "removed", file.unlink, lambda f=file, d=data: f.write_bytes(d)


def test_damage_to_any_file_is_named_and_the_resume_falls_back_to_the_intact_checkpoint(saved, capsys):
    newest, older = checkpoint_dir(saved / "checkpoints", 2), checkpoint_dir(saved / "checkpoints", 1)
    config = _config(saved)
    cases = 0
    for name, what, damage, undo in _damages(newest):
        damage()
        try:
            problem = verify(newest)
            assert problem is not None, (name, what)
            # The damaged file is named, or for the manifest itself, the manifest.
            assert str(newest / name) in problem, (name, what, problem)
            assert RunDir(saved).check(config, resume=True) == older, (name, what)
            lines = capsys.readouterr().out.splitlines()
            assert lines == [f"checkpoint {newest} is damaged: {problem}; falling back to an older checkpoint"]
        finally:
            undo()
        cases += 1
    assert verify(newest) is None
    assert cases == 3 * (len(files_of(newest)) - 1)  # every file but COMPLETE, three ways


def test_the_hf_export_verifies_on_its_own(saved):
    hf = checkpoint_dir(saved / "checkpoints", 1) / HF_DIR
    weights = hf / "model.safetensors"
    data = weights.read_bytes()
    try:
        weights.write_bytes(data[: len(data) // 2])
        assert verify(hf) == f"{weights} has {len(data) // 2} bytes, the manifest says {len(data)}"
    finally:
        weights.write_bytes(data)
    assert verify(hf) is None


def test_no_intact_checkpoint_left_means_none(saved, capsys):
    paths = [checkpoint_dir(saved / "checkpoints", s) for s in (1, 2)]
    manifests = [(p / MANIFEST_FILE).read_bytes() for p in paths]
    try:
        for p in paths:
            (p / MANIFEST_FILE).unlink()
        assert newest_intact(saved / "checkpoints") is None
        assert [line.split(" is damaged: ")[1] for line in capsys.readouterr().out.splitlines()] == [
            f"{p / MANIFEST_FILE} is missing; falling back to an older checkpoint" for p in reversed(paths)]
    finally:
        for p, m in zip(paths, manifests):
            (p / MANIFEST_FILE).write_bytes(m)


def test_prune_keeps_the_newest(tmp_path):
    for s in (1, 2, 3):
        checkpoint_dir(tmp_path, s).mkdir()
        (checkpoint_dir(tmp_path, s) / COMPLETE_FILE).write_text("")
    assert prune(tmp_path, 0) == []
    assert prune(tmp_path, 2) == [checkpoint_dir(tmp_path, 1)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000003"]


@pytest.mark.parametrize("where,code", [("dcp", errno.ENOSPC), ("hf", errno.EROFS), ("manifest", errno.EIO)])
def test_a_storage_fault_during_a_save_names_the_file_and_leaves_no_partial_dir(
        core, saved, tmp_path, monkeypatch, where, code):
    from torch.distributed.checkpoint.filesystem import FileSystem

    import rlactors.trainer.checkpoint as ckpt
    import rlactors.trainer.core as core_module

    def fail(*args, **kwargs):
        raise OSError(code, "injected")  # as a failed write() raises it: naming no file

    if where == "dcp":
        monkeypatch.setattr(FileSystem, "create_stream", fail)
    elif where == "hf":
        monkeypatch.setattr(core_module, "save_pretrained", fail)
    else:
        monkeypatch.setattr(ckpt, "write_manifest", fail)  # the commit's first write after the state file
    with pytest.raises(OSError) as raised:
        core.save_checkpoint(tmp_path, step=1)
    assert raised.value.errno == code
    assert raised.value.filename is not None and str(tmp_path) in raised.value.filename
    assert list(tmp_path.iterdir()) == []  # neither the step dir nor its partial dir


def test_a_damaged_hf_export_given_as_model_path_is_named_before_any_proc_starts(saved):
    from rlactors.models.checkpoint import check_checkpoint_dir

    hf = checkpoint_dir(saved / "checkpoints", 1) / HF_DIR
    check_checkpoint_dir(hf)
    weights = hf / "model.safetensors"
    data = weights.read_bytes()
    try:
        weights.write_bytes(data[:-8] + bytes(8))  # the same size, its last 8 bytes zeroed
        with pytest.raises(ValueError, match=f"^{hf} is damaged: {weights} does not match its checksum"):
            check_checkpoint_dir(hf)
    finally:
        weights.write_bytes(data)
