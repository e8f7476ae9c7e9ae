"""Checkpoint round trip (bit-identical continuation), atomicity, pruning, corruption and mismatch errors,
and 2-rank FSDP2 runs (gloo on CPU always; NCCL and CUDA RNG only where GPUs exist)."""

import copy
import json
import random
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from xmoe.train import checkpoint as ckpt
from xmoe.train import checkpoint_dir, checkpoint_verify, rundir
from xmoe.train.checkpoint import CheckpointError, find_latest, load_checkpoint, save_checkpoint

V, H = 17, 8  # vocab, hidden


def _model(seed=0, hidden=H, layers=1, device="cpu"):
    torch.manual_seed(seed)
    blocks = [nn.Embedding(V, hidden), nn.Dropout(0.2)]  # dropout: the torch RNG must be restored too
    blocks += [nn.Linear(hidden, hidden) for _ in range(layers - 1)]
    model = nn.Sequential(*blocks, nn.Linear(hidden, V)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _train(model, opt, sched, steps):
    """Data draws from python random, numpy and torch, so all three RNG states matter for continuation."""
    losses = []
    for _ in range(steps):
        ids = (torch.randint(V, (4, 6)) + random.randrange(V) + int(np.random.randint(V))) % V
        ids = ids.to(next(model.parameters()).device)  # on a GPU, dropout draws from the CUDA generator
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


def _save(out, step, model, opt, sched, keep_last=3):
    return save_checkpoint(out, step, model, opt, {"sched": sched.state_dict(), "data_pos": step * 4}, keep_last)


def test_round_trip_is_bit_identical(tmp_path):
    random.seed(1), np.random.seed(1)
    model, opt, sched = _model()
    _train(model, opt, sched, 3)
    path = _save(tmp_path, 3, model, opt, sched)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())  # state tensors are updated in place
    expected = _train(model, opt, sched, 3)

    random.seed(99), np.random.seed(99), torch.manual_seed(99)  # scramble every RNG before resuming
    model2, opt2, sched2 = _model(seed=5)
    extra = load_checkpoint(tmp_path, model2, opt2)
    sched2.load_state_dict(extra["sched"])
    assert extra["data_pos"] == 12 and extra["step"] == 3
    for k, v in model2.state_dict().items():
        assert torch.equal(v, saved[k]), k
    for i, state in opt2.state_dict()["state"].items():
        for name, value in state.items():
            assert torch.equal(value, saved_opt["state"][i][name]), (i, name)
    assert opt2.param_groups[0]["lr"] == saved_opt["param_groups"][0]["lr"]
    assert _train(model2, opt2, sched2, 3) == expected  # exact float equality, not approx

    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 3 and meta["world_size"] == 1
    assert all(entry["size"] > 0 and len(entry["crc32"]) == 8 for entry in meta["files"].values())


def test_keep_last_and_latest_pointer(tmp_path):
    model, opt, sched = _model()
    for step in range(1, 6):
        _save(tmp_path, step, model, opt, sched, keep_last=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000004", "step_000005"]
    assert find_latest(tmp_path) == root / "step_000005"
    # A save below existing steps leaves the newer dirs; a resume scans, so it still finds the newest, until
    # the newer ones are set aside (what resuming from an older checkpoint does)
    _save(tmp_path, 3, model, opt, sched, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000003", "step_000004", "step_000005"]
    assert (root / "latest").read_text().strip() == "step_000003"
    assert find_latest(tmp_path) == root / "step_000005"
    moved = checkpoint_dir.set_aside_newer(tmp_path, 3)
    assert sorted(p.name.split(".")[0] for p in moved) == ["step_000004", "step_000005"]
    assert find_latest(tmp_path) == root / "step_000003"
    for path in moved:
        path.rename(root / path.name.split(".")[0])
    # Saving an existing step again replaces it in place; with keep_last=1 the older steps 3 and 4 go.
    _save(tmp_path, 5, model, opt, sched, keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000005"]
    with pytest.raises(ValueError, match="keep_last"):
        save_checkpoint(tmp_path, 6, model, opt, keep_last=0)


@pytest.mark.parametrize(
    "module, fail_in",
    [(checkpoint_verify, "_crc32"), (checkpoint_dir, "_publish")],
    ids=["after the DCP write", "after COMPLETE"],
)
def test_crash_during_save_leaves_previous_checkpoint(tmp_path, monkeypatch, module, fail_in):
    model, opt, sched = _model()
    good = _save(tmp_path, 1, model, opt, sched)

    def crash(*args, **kwargs):
        raise OSError("simulated crash")

    monkeypatch.setattr(module, fail_in, crash)
    with pytest.raises(CheckpointError, match="simulated crash"):
        _save(tmp_path, 2, model, opt, sched)
    assert sorted(p.name for p in good.parent.iterdir()) == ["latest", "step_000001"]  # temp dir removed
    # A hard kill cannot clean up: the temp dir (complete-looking inside) must still be ignored.
    monkeypatch.setattr(rundir, "_discard", lambda path: None)  # the save's clean-up is RunDir.save's
    with pytest.raises(CheckpointError):
        _save(tmp_path, 2, model, opt, sched)
    monkeypatch.undo()
    leftovers = [p for p in good.parent.iterdir() if ".tmp-" in p.name]
    assert len(leftovers) == 1
    assert find_latest(tmp_path) == good
    assert load_checkpoint(tmp_path, *_model()[:2])["step"] == 1
    with pytest.raises(CheckpointError, match="unfinished save"):
        load_checkpoint(leftovers[0], *_model()[:2])
    _save(tmp_path, 2, model, opt, sched)  # the next save sweeps the leftover
    assert sorted(p.name for p in good.parent.iterdir()) == ["latest", "step_000001", "step_000002"]


def _corrupt_truncate(path):
    shard = next(path.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])


def _corrupt_flip(path):
    shard = next(path.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (_corrupt_truncate, "truncated"),
        (_corrupt_flip, "crc32"),
        (lambda p: next(p.glob("*.distcp")).unlink(), "is missing"),
        (lambda p: (p / "meta.json").write_text("{not json"), "corrupt meta.json"),
        (lambda p: (p / "COMPLETE").unlink(), "incomplete"),
    ],
)
def test_corrupt_checkpoint_errors(tmp_path, corrupt, message):
    model, opt, sched = _model()
    previous = _save(tmp_path, 1, model, opt, sched)
    bad = _save(tmp_path, 2, model, opt, sched)
    corrupt(bad)
    with pytest.raises(CheckpointError, match=message) as info:
        load_checkpoint(bad, *_model()[:2])
    assert str(bad) in str(info.value) and str(previous) in str(info.value)  # names it and the way out
    if message == "incomplete":
        assert find_latest(tmp_path) == previous  # pointer names step 2, but it is not complete


def test_missing_paths(tmp_path):
    model, opt, _ = _model()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nope", model, opt)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_checkpoint(tmp_path, model, opt)
    assert find_latest(tmp_path) is None


def test_mismatched_model_names_keys(tmp_path):
    model, opt, sched = _model()
    _save(tmp_path, 1, model, opt, sched)
    wider, wider_opt, _ = _model(hidden=H + 2)
    with pytest.raises(ValueError, match=r"model\.0\.weight: model \[17, 10\] vs checkpoint \[17, 8\]"):
        load_checkpoint(tmp_path, wider, wider_opt)
    deeper = _model(layers=2)[0]
    with pytest.raises(ValueError, match=r"missing from checkpoint: model\.3\.weight"):
        load_checkpoint(tmp_path, deeper)
    with pytest.raises(ValueError, match="no optimizer state"):
        save_checkpoint(tmp_path, 2, model, None, keep_last=5)
        load_checkpoint(tmp_path, model, opt)
    assert load_checkpoint(tmp_path, model)["step"] == 2  # model-only load works


def test_world_size_change_needs_restore_extra_false(tmp_path):
    model, opt, sched = _model()
    path = _save(tmp_path, 1, model, opt, sched)
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "world_size": 2}))
    with pytest.raises(ValueError, match="restore_extra=False"):
        load_checkpoint(path, model, opt)
    assert load_checkpoint(path, model, opt, restore_extra=False) == {"step": 1}


# ---------------------------------------------------------------------------------------- two ranks


def _fsdp2_round_trip(rank, out, device):
    """Body run by each of 2 ranks (process group already up): FSDP2 save, continue, reload, compare."""
    from torch.distributed.fsdp import fully_shard

    def build():
        model, _, _ = _model(device=device)
        for layer in model:
            if isinstance(layer, (nn.Linear, nn.Embedding)):
                fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # over the DTensor shards
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    model, opt, sched = build()
    torch.manual_seed(rank), random.seed(rank), np.random.seed(rank)  # per-rank data, per-rank RNG
    if device != "cpu":
        torch.cuda.manual_seed(rank)
    _train(model, opt, sched, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = _save(out, 2, model, opt, sched)
    assert not [w for w in caught if "differ across ranks" in str(w.message)]  # FSDP2 state is DTensors
    expected = _train(model, opt, sched, 2)

    model2, opt2, sched2 = build()
    torch.manual_seed(123), torch.cuda.manual_seed_all(123)
    extra = load_checkpoint(out, model2, opt2)
    sched2.load_state_dict(extra["sched"])
    assert _train(model2, opt2, sched2, 2) == expected
    assert sorted(p.name for p in path.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert json.loads((path / "meta.json").read_text())["world_size"] == 2
    # Hand-sharded plain tensors (differing per rank) would be saved from one rank only: warned about.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        local = torch.full((2,), rank + 1.0, device=device)
        ckpt._warn_unsynced_replicas(ckpt._fingerprints({"model": {"experts.w": local}}))
    assert any("experts.w" in str(w.message) for w in caught)


def _gloo_rank(rank, world_size, out):
    _fsdp2_round_trip(rank, out, "cpu")


def test_two_rank_fsdp2_round_trip(tmp_path):
    from dist_utils import run_distributed

    run_distributed(_gloo_rank, 2, str(tmp_path))


def _nccl_rank(rank, port, out):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        _fsdp2_round_trip(rank, out, f"cuda:{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
def test_two_rank_fsdp2_round_trip_nccl(tmp_path):
    from dist_utils import free_port

    # spawn: CUDA cannot be used in a forked child; join() re-raises a rank's exception here.
    torch.multiprocessing.spawn(_nccl_rank, args=(free_port(), str(tmp_path)), nprocs=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_round_trip_restores_cuda_rng(tmp_path):
    model, opt, sched = _model(device="cuda")
    _train(model, opt, sched, 2)
    _save(tmp_path, 2, model, opt, sched)
    expected = _train(model, opt, sched, 3)
    torch.cuda.manual_seed(7)
    model2, opt2, sched2 = _model(seed=3, device="cuda")
    sched2.load_state_dict(load_checkpoint(tmp_path, model2, opt2)["sched"])
    assert _train(model2, opt2, sched2, 3) == expected


def test_find_latest_skips_a_damaged_newest_checkpoint(tmp_path):
    model, opt, sched = _model()
    good = _save(tmp_path, 1, model, opt, sched)
    bad = _save(tmp_path, 2, model, opt, sched)
    _corrupt_truncate(bad)  # complete-looking, but a shard lost its tail (e.g. the disk filled after COMPLETE)
    with pytest.warns(UserWarning, match="skipped 1 newer checkpoint"):
        assert find_latest(tmp_path) == good
    _corrupt_truncate(good)
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        find_latest(tmp_path)
