"""Tests for checkpoint integrity: tfx.train.checksums against its written-out formula, damaged
array bytes caught on restore (fallback, strict), checkpoints written before checksums, and a
failed background save reported by `check`."""

import errno
import pathlib
import time
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint._src.serialization import serialization
from train_cases import damage_payload

from tfx.train import checksums
from tfx.train.checkpoint import Checkpoints, CorruptCheckpointError

CONFIG = {"model": "integrity"}


def random_state(step: int) -> dict:
    """Random bits (incompressible, so orbax stores them as they are; 4 KiB, more than OCDBT
    keeps inline in its CRC-checked b-tree nodes, so nothing but our checksums guards them)
    and a float leaf."""
    rng = np.random.default_rng(step)
    return {"w": jnp.asarray(rng.integers(0, 2**31, (32, 32), dtype=np.int32)),
            "b": jnp.asarray(rng.standard_normal(8, dtype=np.float32)), "step": jnp.int32(step)}


def reference_checksum(words: np.ndarray) -> str:
    """The module docstring's formula, one word at a time in python integers."""
    def fmix32(h):
        h ^= h >> 16
        h = (h * 0x85EBCA6B) % 2**32
        h ^= h >> 13
        h = (h * 0xC2B2AE35) % 2**32
        return h ^ (h >> 16)
    lanes = [sum(fmix32(int(w) ^ fmix32(i ^ seed)) for i, w in enumerate(words.ravel())) % 2**32
             for seed in (0x9E3779B9, 0x7F4A7C15)]
    return "".join(f"{lane:08x}" for lane in lanes)


def test_checksum_matches_the_formula_on_device_and_host():
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    tree = {"device": jnp.asarray(x), "host": x, "bf16": jnp.asarray(x, jnp.bfloat16),
            "f64": x.astype(np.float64), "flag": True, "key": jax.random.key(4)}
    got = checksums.checksums(tree)
    assert got["device"] == got["host"] == reference_checksum(x.view(np.uint32))
    bf16_bits = np.asarray(jnp.asarray(x, jnp.bfloat16)).view(np.uint16)
    assert got["bf16"] == reference_checksum(bf16_bits.astype(np.uint32))
    assert got["f64"] == reference_checksum(x.astype(np.float64).view(np.uint32))  # low, high
    assert got["flag"] == reference_checksum(np.array([1], np.uint32))
    assert got["key"] == reference_checksum(np.asarray(jax.random.key_data(tree["key"])))


def test_checksum_changes_with_one_bit_or_swapped_words():
    x = np.arange(16, dtype=np.uint32).reshape(4, 4)
    base = checksums.checksums({"x": x})["x"]
    flipped, swapped = x.copy(), x.copy()
    flipped[2, 1] ^= 1 << 30
    swapped[0, [0, 3]] = swapped[0, [3, 0]]
    for other in (flipped, swapped):
        got = checksums.checksums({"x": other})["x"]
        assert got[:8] != base[:8] and got[8:] != base[8:]  # both lanes change


# When one of several concurrent tensorstore reads fails, orbax closes its event loop while
# the others are still pending (see test_checkpoint.py): harmless.
IGNORE_LATE_READS = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def three_steps_with_step_3_damaged(directory: pathlib.Path, how: str) -> None:
    with Checkpoints(directory, config=CONFIG, keep=3) as ckpts:
        for step in (1, 2, 3):
            ckpts.save(step, random_state(step))
    damage_payload(directory / "3", np.asarray(random_state(3)["w"]), how)


@IGNORE_LATE_READS
@pytest.mark.parametrize("how", ["flip_bit", "random_bytes"])
def test_damaged_array_bytes_fall_back_to_the_previous_step(tmp_path, how):
    three_steps_with_step_3_damaged(tmp_path, how)
    with Checkpoints(tmp_path, config=CONFIG) as ckpts:
        with pytest.warns(RuntimeWarning, match=r"step 3 .* is unreadable .*checksums: w\)"):
            step, state = ckpts.restore(random_state(0))
        assert step == 2
        chex.assert_trees_all_equal(state, random_state(2))
        # The damaged step stays on disk until training saves step 3 again.
        assert ckpts.all_steps() == [1, 2, 3]
        ckpts.save(3, random_state(3))
        ckpts.wait()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            step, state = ckpts.restore(random_state(0))
        assert step == 3
        chex.assert_trees_all_equal(state, random_state(3))


@IGNORE_LATE_READS
def test_strict_restore_refuses_a_damaged_newest_step(tmp_path):
    three_steps_with_step_3_damaged(tmp_path, "flip_bit")
    with Checkpoints(tmp_path, config=CONFIG) as ckpts, warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, hence no warning either
        with pytest.raises(CorruptCheckpointError,
                           match=rf"step 3 in {tmp_path} .*checksums: w\); not falling back"):
            ckpts.restore(random_state(0), strict=True)
        with pytest.raises(CorruptCheckpointError, match="step 3"):  # a step asked for by name
            ckpts.restore(random_state(0), step=3)
        assert ckpts.restore(random_state(0), step=2, strict=True)[0] == 2
        with pytest.raises(TypeError, match="strict must be a bool, got 'yes'"):
            ckpts.restore(random_state(0), strict="yes")


def test_an_unreadable_step_is_reported_on_one_line(tmp_path, monkeypatch):
    # TensorStore read errors put a many-line spec dump after the reason: the report keeps
    # the reason's line and still says, on that line, that it does not fall back.
    spec_dump = "Encountered error while reading array index: (0, 0). See full TensorStore "
    spec_dump += "details: <spec of TensorStore({\n  'driver': 'zarr',\n})>."
    def unreadable(*args, **kwargs):
        raise ValueError(spec_dump)

    with Checkpoints(tmp_path, config=CONFIG) as ckpts:
        ckpts.save(1, random_state(1))
        ckpts.wait()
        monkeypatch.setattr(ckpts._manager, "restore", unreadable)
        with pytest.raises(CorruptCheckpointError) as info:
            ckpts.restore(random_state(0), strict=True)
    message = str(info.value)
    assert "\n" not in message and "TensorStore" not in message, message
    assert message == (f"checkpoint step 1 in {tmp_path} is unreadable (ValueError: Encountered "
                       "error while reading array index: (0, 0).); not falling back to an "
                       "older step")


@IGNORE_LATE_READS
def test_damage_is_caught_when_restoring_into_another_dtype(tmp_path):
    three_steps_with_step_3_damaged(tmp_path, "flip_bit")
    template = {**random_state(0), "w": jax.ShapeDtypeStruct((32, 32), jnp.float32)}
    with (Checkpoints(tmp_path, config=CONFIG) as ckpts,
          pytest.warns(RuntimeWarning, match=r"step 3 .*checksums: w\)")):
        step, state = ckpts.restore(template)
    assert step == 2 and state["w"].dtype == jnp.float32
    np.testing.assert_array_equal(state["w"], np.asarray(random_state(2)["w"], np.float32))


def test_host_float64_restores_verified_into_a_device_float32_template(tmp_path):
    # jax (without x64) cannot hold the stored float64: it is read and verified on the host.
    host = np.random.default_rng(0).standard_normal(600)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with Checkpoints(tmp_path, config=CONFIG) as ckpts, warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpts.save(1, {"h": host})
        _, out = ckpts.restore({"h": jax.ShapeDtypeStruct((600,), jnp.float32, sharding=device)})
    assert isinstance(out["h"], jax.Array) and out["h"].sharding == device
    np.testing.assert_array_equal(out["h"], host.astype(np.float32))


def test_checkpoint_written_before_checksums_restores_unverified(tmp_path):
    # What tfx wrote before checksums: one orbax item, no checksums.
    options = ocp.CheckpointManagerOptions(create=True)
    with ocp.CheckpointManager(tmp_path, options=options,
                               item_handlers=ocp.StandardCheckpointHandler()) as old:
        old.save(1, args=ocp.args.StandardSave(random_state(1)))
    with Checkpoints(tmp_path, config=CONFIG) as ckpts:
        with pytest.warns(UserWarning, match=f"step 1 in {tmp_path} has no checksums"):
            step, state = ckpts.restore(random_state(0))
        assert step == 1
        chex.assert_trees_all_equal(state, random_state(1))
        ckpts.save(2, random_state(2))  # the resumed run writes checksums from now on
        ckpts.wait()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert ckpts.restore(random_state(0))[0] == 2
    assert (tmp_path / "2" / "checksums").is_dir() and not (tmp_path / "1" / "checksums").exists()


def test_failed_background_save_is_reported_by_check(tmp_path, monkeypatch):
    async def disk_full(*args, **kwargs):
        await serialization.asyncio.sleep(0.2)  # fail while the training loop goes on
        raise OSError(errno.ENOSPC, "No space left on device")

    with Checkpoints(tmp_path, config=CONFIG, keep=1, async_save=True) as ckpts:
        ckpts.save(1, random_state(1))
        ckpts.wait()
        monkeypatch.setattr(serialization, "async_serialize_from_host", disk_full)
        assert ckpts.save(2, random_state(2))  # returns while step 2 is being written
        ckpts.check()  # still writing: no error yet, and no waiting
        deadline = time.monotonic() + 60
        with pytest.raises(OSError, match="No space left") as info:
            while time.monotonic() < deadline:  # the training loop: one check per step
                ckpts.check()
                time.sleep(0.01)
        assert f"step 2 in {tmp_path} failed" in "\n".join(info.value.__notes__)
        ckpts.check()  # reported once
        # Step 1 would have been rotated out by step 2: it is kept, and restores.
        assert ckpts.all_steps() == [1] and (tmp_path / "1").is_dir()
        step, state = ckpts.restore(random_state(0))
        assert step == 1
        chex.assert_trees_all_equal(state, random_state(1))
        monkeypatch.undo()
        ckpts.save(2, random_state(2))  # the same step saves fine once the disk has room
        ckpts.wait()
        assert ckpts.all_steps() == [2]


def test_a_read_only_opening_writes_nothing_and_keeps_an_in_flight_save(tmp_path):
    # What `tfx eval` / `tfx sample` / `train.init_from` open while a run trains there: a
    # writer's opening removes orbax's temporary folders, i.e. the run's save in flight.
    with Checkpoints(tmp_path, config=CONFIG) as ckpts:
        ckpts.save(1, random_state(1))
    in_flight = tmp_path / "2.orbax-checkpoint-tmp-1700000000000000"
    in_flight.mkdir()
    with Checkpoints(tmp_path, config=CONFIG, read_only=True) as reader:
        assert reader.restore(random_state(0), strict=True)[0] == 1
        with pytest.raises(ValueError, match="opened read_only"):
            reader.save(2, random_state(2))
    assert in_flight.is_dir()
    with Checkpoints(tmp_path / "new", config=CONFIG, read_only=True) as reader:
        assert reader.restore(random_state(0)) is None
    assert not (tmp_path / "new").exists()
