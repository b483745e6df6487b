"""Truncated or missing checkpoint files (issue 20, Why 5): named in one line, and a resume falls back to the newest
complete checkpoint, as it already does for a missing ``latest``."""

from __future__ import annotations

import shutil
import time

import pytest

from sapo_megatron.checkpoint import atomic
from sapo_megatron.checkpoint.hf_io import CheckpointError, HFCheckpointReader
from sapo_megatron.rollout.cpu.server import ServeError, serve
from sapo_megatron.runtime.run_dir import find_checkpoint
from tests.rollout.conftest import engine_from


def fake_train_state(root, name: str, step: int):
    """A checkpoint directory as ``save_train_state`` leaves it (shard files, ``.metadata``, marker)."""
    path = root / name
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"s" * 4096)
    (path / ".metadata").write_bytes(b"m" * 300)
    atomic.write_marker(path, "train_state", extra={"step": step})
    atomic.update_latest(path)
    time.sleep(0.01)  # distinct creation times
    return path


def test_a_truncated_or_incomplete_newest_checkpoint_falls_back_to_the_previous(tmp_path):
    root = tmp_path / "checkpoints"
    fake_train_state(root, "step_000001", 1)
    newest = fake_train_state(root, "step_000002", 2)
    found, note = find_checkpoint(root)
    assert found.path.name == "step_000002" and note is None
    with open(newest / "__0_0.distcp", "r+b") as shard:  # disk full / kill -9 while copying
        shard.truncate(1000)
    found, note = find_checkpoint(root)
    assert found.path.name == "step_000001" and found.extra == {"step": 1}
    assert "__0_0.distcp has 1000 bytes, the save wrote 4096: the file is truncated" in note
    (newest / "__0_0.distcp").write_bytes(b"s" * 4096)
    (newest / ".metadata").unlink()
    found, note = find_checkpoint(root)
    assert found.path.name == "step_000001" and ".metadata is missing from the checkpoint" in note


def test_a_truncated_model_safetensors_is_named_by_serve_reader_and_reload(moe_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(moe_dir, broken)
    weights = broken / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as file:
        file.truncate(size // 2)
    with pytest.raises(CheckpointError, match=f"{weights} is truncated: its header describes {size} bytes"):
        HFCheckpointReader(broken)
    with pytest.raises(ServeError, match=r"model\.safetensors is truncated"):
        serve(broken, port=0, block=False)
    engine = engine_from(moe_dir)
    with pytest.raises(CheckpointError, match="is truncated"):
        engine.update_weights_from_disk(str(broken))
    with open(weights, "r+b") as file:
        file.truncate(5)  # not even the header length
    with pytest.raises(CheckpointError, match=r"is truncated \(5 bytes; its header alone needs more\)"):
        HFCheckpointReader(broken)


def test_a_full_disk_while_saving_is_one_line_naming_the_checkpoint(tmp_path):
    import errno

    from sapo_megatron.megatron.dist_ckpt import CheckpointWriteError, _explain_disk_errors

    final = tmp_path / "checkpoints" / "step_000003"
    for error in (
        OSError(errno.ENOSPC, "No space left on device"),
        RuntimeError("[enforce fail] No space left"),
    ):
        with pytest.raises(CheckpointWriteError) as caught, _explain_disk_errors(final):
            raise error
        assert str(caught.value).startswith(f"cannot write checkpoint {final}: the disk is full")
        assert "free space under" in caught.value.hint
    with pytest.raises(RuntimeError, match="a bug"), _explain_disk_errors(final):  # not a disk problem
        raise RuntimeError("a bug")
