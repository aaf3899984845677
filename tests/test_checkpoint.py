"""model/runtime/checkpoint.py in one process: save/restore round trips, resume order, fingerprint.

    pytest tests/test_checkpoint.py -q      (~30 s on 2 cores; 8 fake CPU devices)

Whole runs (kills, preemption, other process counts) are in tests/test_resume.py.
"""
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from omegaconf import OmegaConf

from model import sharding as shd
from model import step as step_lib
from model.llama import LlamaConfig
from model.optimizer import make_optimizer
from model.runtime.checkpoint import (
    Checkpointer,
    DamagedCheckpoint,
    DataStateHandler,
    check_fingerprint,
    complete_steps,
    damage_reason,
    fingerprint_diffs,
    split_step_dir,
)

ROOT = Path(__file__).resolve().parents[1]
MODEL = LlamaConfig.from_mapping(OmegaConf.load(ROOT / "configs/model/tiny.yaml"))
OPT = OmegaConf.load(ROOT / "configs/optimizer/adamw.yaml")


def mesh_and_rules(name):
    mcfg = OmegaConf.load(ROOT / f"configs/mesh/{name}.yaml")
    return shd.make_mesh(mcfg), shd.rules_from_cfg(mcfg)


@pytest.fixture(scope="module")
def setup():
    tx, _ = make_optimizer(OPT, 100)
    mesh, rules = mesh_and_rules("default")
    state, shardings = step_lib.init_train_state(MODEL, tx, mesh, rules, seed=0)
    return tx, mesh, rules, state


def ccfg(directory, **kw):
    return {"dir": str(directory), "every": 2, "keep": 3, "async": True, "resume_from": None, "init_from": None,
            "allow_data_change": False, **kw}


def host_copy(tree):
    return jax.tree.map(lambda x: np.array(x), tree)


def assert_tree_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb, strict=False):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


DATA_STATE = {"__vshards__": 1, "num_shards": 8, "rr": 3,
              "shards": {"0": {"emitted": 5, "carry": [1, 2, 3], "pair": [-1, -1]}}}
META = {"fingerprint": {"data": {"seq_len": 64}, "model": {"d_model": 128}}, "wandb_id": "abc123",
        "process_count": 1, "num_workers": 0}


# ---------------------------------------------------------------- round trip
@pytest.mark.slow
def test_roundtrip_restores_into_another_sharding(setup, tmp_path):
    tx, mesh, rules, state = setup
    expected = host_copy(state)
    ckpt = Checkpointer(ccfg(tmp_path / "ckpt"))
    ckpt.save(4, state, DATA_STATE, META)
    ckpt.close()

    # A new process (a restart): everything comes back, the arrays straight into an FSDP layout.
    ckpt = Checkpointer(ccfg(tmp_path / "ckpt"))
    resume = ckpt.find_resume()
    assert (resume.source, resume.step) == ("latest", 4)
    meta, data_states = ckpt.restore_meta_and_data(resume)
    assert meta == META
    assert data_states == [DATA_STATE]
    fsdp_mesh, fsdp_rules = mesh_and_rules("fsdp")
    abstract, shardings = step_lib.abstract_train_state(MODEL, tx, fsdp_mesh, fsdp_rules)
    restored = ckpt.restore_state(resume, abstract)
    ckpt.close()
    assert_tree_equal(restored, expected)
    for arr, sh in zip(jax.tree.leaves(restored), jax.tree.leaves(shardings), strict=False):
        assert arr.sharding == sh
    assert int(restored["step"]) == int(expected["step"])


def test_async_save_is_a_snapshot(setup, tmp_path):
    """The loop donates the state to the next step while the save is still writing: the
    checkpoint must hold the values at save() time, not whatever the buffers hold later."""
    tx, mesh, rules, state = setup
    state = jax.tree.map(jnp.copy, state)
    before = host_copy(state)
    bump = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
    ckpt = Checkpointer(ccfg(tmp_path / "ckpt"))
    ckpt.save(2, state, DATA_STATE, META)
    for _ in range(3):
        state = bump(state)
    jax.block_until_ready(state)
    ckpt.wait()
    abstract, _ = step_lib.abstract_train_state(MODEL, tx, mesh, rules)
    restored = ckpt.restore_state(ckpt.find_resume(), abstract)
    ckpt.close()
    assert_tree_equal(restored, before)


def test_keep_last_n_and_should_save(setup, tmp_path):
    _, _, _, state = setup
    ckpt = Checkpointer(ccfg(tmp_path / "ckpt", keep=2, every=3))
    assert [s for s in range(1, 11) if ckpt.should_save(s, 10)] == [3, 6, 9, 10]
    for s in (3, 6, 9, 10):
        ckpt.save(s, state, {"s": s}, META)
    ckpt.close()
    steps = sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit())
    assert steps == [9, 10]
    assert not Checkpointer(ccfg(tmp_path / "x", every=0)).should_save(5, 10)


def test_partial_step_is_ignored_and_removed(setup, tmp_path):
    """What a SIGKILL during an asynchronous save leaves: an unfinalised tmp directory."""
    _, _, _, state = setup
    ckpt = Checkpointer(ccfg(tmp_path / "ckpt"))
    ckpt.save(2, state, {"s": 2}, META)
    ckpt.close()
    partial = tmp_path / "ckpt" / "4.orbax-checkpoint-tmp-1700000000000000"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "junk").write_text("half a checkpoint")
    ckpt = Checkpointer(ccfg(tmp_path / "ckpt"))
    assert ckpt.find_resume().step == 2
    _, data_states = ckpt.restore_meta_and_data(ckpt.find_resume())
    assert data_states == [{"s": 2}]
    ckpt.save(4, state, {"s": 4}, META)       # the same step again, now complete
    ckpt.close()
    assert not partial.exists()
    assert Checkpointer(ccfg(tmp_path / "ckpt")).find_resume().step == 4


# ---------------------------------------------------------------- resume order
def test_resume_order(setup, tmp_path):
    tx, mesh, rules, state = setup
    other = Checkpointer(ccfg(tmp_path / "other"))
    for s in (2, 4):
        other.save(s, state, {"s": s}, META)
    other.close()

    # Nothing anywhere: scratch.
    assert Checkpointer(ccfg(tmp_path / "a")).find_resume() is None
    # resume_from a manager directory -> its latest step; a step directory -> that step.
    r = Checkpointer(ccfg(tmp_path / "b", resume_from=str(tmp_path / "other"))).find_resume()
    assert (r.source, r.directory, r.step) == ("resume_from", str(tmp_path / "other"), 4)
    ckpt = Checkpointer(ccfg(tmp_path / "b", resume_from=str(tmp_path / "other" / "2")))
    r = ckpt.find_resume()
    assert (r.source, r.step) == ("resume_from", 2)
    assert ckpt.restore_meta_and_data(r)[1] == [{"s": 2}]
    # Once this run has its own checkpoint, it wins over resume_from.
    ckpt.save(6, state, {"s": 6}, META)
    ckpt.close()
    r = Checkpointer(ccfg(tmp_path / "b", resume_from=str(tmp_path / "other"))).find_resume()
    assert (r.source, r.step) == ("latest", 6)

    # Mistakes name the setting.
    with pytest.raises(ValueError, match="checkpoint.resume_from=.*no such"):
        Checkpointer(ccfg(tmp_path / "c", resume_from=str(tmp_path / "nope"))).find_resume()
    assert not (tmp_path / "nope").exists()
    with pytest.raises(ValueError, match=r"step 3 is not a complete checkpoint.*\[2, 4\]"):
        Checkpointer(ccfg(tmp_path / "c", resume_from=str(tmp_path / "other" / "3"))).find_resume()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no complete checkpoint"):
        Checkpointer(ccfg(tmp_path / "c", resume_from=str(tmp_path / "empty"))).find_resume()


def test_init_from_restores_parameters_only(setup, tmp_path):
    tx, mesh, rules, state = setup
    other = Checkpointer(ccfg(tmp_path / "other"))
    other.save(4, state, {"s": 4}, META)
    other.close()
    fsdp_mesh, fsdp_rules = mesh_and_rules("fsdp")
    abstract, shardings = step_lib.abstract_train_state(MODEL, tx, fsdp_mesh, fsdp_rules)
    ckpt = Checkpointer(ccfg(tmp_path / "new", init_from=str(tmp_path / "other")))
    assert ckpt.find_resume() is None          # init_from is not a resume
    params = ckpt.restore_params(str(tmp_path / "other"), abstract["params"])
    ckpt.close()
    assert_tree_equal(params, host_copy(state["params"]))
    for arr, sh in zip(jax.tree.leaves(params), jax.tree.leaves(shardings["params"]), strict=False):
        assert arr.sharding == sh
    with pytest.raises(ValueError, match="checkpoint.init_from"):
        Checkpointer(ccfg(tmp_path / "new2")).restore_params(str(tmp_path / "missing"), abstract["params"])


def test_split_step_dir():
    assert split_step_dir("gs://b/run/checkpoints/1200") == ("gs://b/run/checkpoints", 1200)
    assert split_step_dir("gs://b/run/checkpoints/") == ("gs://b/run/checkpoints", None)
    assert split_step_dir("/r/ck") == ("/r/ck", None)


# ---------------------------------------------------------------- data states of every process
def test_data_handler_returns_every_process_state(tmp_path):
    h = DataStateHandler()
    for i in range(3):
        (tmp_path / f"process_{i}-of-3.json").write_text(json.dumps({"host": i}))
    assert h.restore(tmp_path) == [{"host": 0}, {"host": 1}, {"host": 2}]
    (tmp_path / "process_1-of-3.json").unlink()
    with pytest.raises(ValueError, match="incomplete data state"):
        h.restore(tmp_path)
    assert h.restore(tmp_path / "nothing_here") is None


def test_data_state_numpy_scalars_are_saved_as_json(setup, tmp_path):
    _, _, _, state = setup
    ckpt = Checkpointer(ccfg(tmp_path / "ckpt"))
    ckpt.save(1, state, {"pos": np.int64(7), "carry": np.arange(3, dtype=np.int32)}, META)
    ckpt.close()
    ckpt = Checkpointer(ccfg(tmp_path / "ckpt"))
    assert ckpt.restore_meta_and_data(ckpt.find_resume())[1] == [{"pos": 7, "carry": [0, 1, 2]}]
    ckpt.close()


# ---------------------------------------------------------------- fingerprint
FP = {"data": {"tokenizer": "t1", "files": "f1", "seq_len": 64, "seed": 0, "packing": "concat", "num_shards": 8},
      "model": {"d_model": 128, "n_layers": 4, "remat": "none", "attention": "xla", "dtype": "float32"}}


def changed(**sections):
    out = json.loads(json.dumps(FP))
    for section, kv in sections.items():
        out[section].update(kv)
    return out


def test_fingerprint_identical_and_json_round_trip():
    assert check_fingerprint(json.loads(json.dumps(FP)), FP, allow_data_change=False) == []
    assert fingerprint_diffs({"data": {"x": [1, 2]}}, {"data": {"x": (1, 2)}}) == []


def test_fingerprint_lists_every_difference():
    with pytest.raises(ValueError) as e:
        check_fingerprint(FP, changed(data={"seq_len": 128, "tokenizer": "t2"}, model={"n_layers": 6}),
                          allow_data_change=False)
    msg = str(e.value)
    for needle in ("data.seq_len: checkpoint=64 now=128", "data.tokenizer: checkpoint='t2'"[:25],
                   "model.n_layers: checkpoint=4 now=6"):
        assert needle in msg, msg


def test_allow_data_change_accepts_data_only():
    now = changed(data={"files": "f2", "num_shards": 16})
    with pytest.raises(ValueError, match="allow_data_change=true"):
        check_fingerprint(FP, now, allow_data_change=False)
    accepted = check_fingerprint(FP, now, allow_data_change=True)
    assert len(accepted) == 2 and all(d.startswith("data.") for d in accepted)
    with pytest.raises(ValueError, match="model.d_model"):
        check_fingerprint(FP, changed(data={"files": "f2"}, model={"d_model": 256}), allow_data_change=True)


def test_runtime_only_model_settings_may_change():
    now = changed(model={"remat": "full", "attention": "splash", "dtype": "bfloat16"})
    assert check_fingerprint(FP, now, allow_data_change=False) == []


def test_model_fields_added_later_compare_at_their_defaults():
    """A checkpoint saved before head_dim, qkv_bias, ... existed names the same network as a preset
    that spells their defaults out (head_dim resolved); a set one is a difference."""
    import dataclasses

    old = {"model": {k: v for k, v in dataclasses.asdict(MODEL).items()
                     if k not in ("head_dim", "qkv_bias", "qk_norm", "sliding_window", "rope_type", "hf_model_type")}}
    now = {"model": {**dataclasses.asdict(MODEL), "head_dim": None}}
    assert fingerprint_diffs(old, now) == []
    assert fingerprint_diffs(old, {"model": {**now["model"], "sliding_window": 64}}) == [
        "model.sliding_window: checkpoint=None now=64"]


# ---------------------------------------------------------------- damaged steps
def _largest_array_file(step_dir):
    return max((step_dir / "state").glob("ocdbt.process_*/d/*"), key=lambda p: p.stat().st_size)


# Each kind of file a step holds, damaged the way a half-written object or a bad disk leaves it.
DAMAGE = {
    "array_chunk_truncated": lambda d: os.truncate(_largest_array_file(d), 1000),
    "array_chunk_missing": lambda d: _largest_array_file(d).unlink(),
    "array_manifest_missing": lambda d: (d / "state" / "manifest.ocdbt").unlink(),
    "array_metadata_unparsable": lambda d: (d / "state" / "_METADATA").write_text('{"tree_metadata": {'),
    "data_state_unparsable": lambda d: (d / "data" / "process_0-of-1.json").write_text('{"shards": {"0'),
    "meta_unparsable": lambda d: (d / "meta" / "metadata").write_text("{not json"),
}


def restore_all(ckpt, abstract):
    """What train.py reads of a resumed step, in its order."""
    resume = ckpt.find_resume()
    meta, states = ckpt.restore_meta_and_data(resume)
    return resume, meta, states, ckpt.restore_state(resume, abstract)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_step_is_named_moved_aside_and_the_previous_one_restores(kind, setup, tmp_path, capsys):
    tx, mesh, rules, state = setup
    ckpt = Checkpointer(ccfg(tmp_path / "ckpt"))
    ckpt.save(2, state, {"s": 2}, META)
    ckpt.save(4, jax.tree.map(lambda x: x + 1, state), {"s": 4}, META)
    ckpt.close()
    DAMAGE[kind](tmp_path / "ckpt" / "4")
    abstract, _ = step_lib.abstract_train_state(MODEL, tx, mesh, rules)

    ckpt = Checkpointer(ccfg(tmp_path / "ckpt"))
    with pytest.raises(DamagedCheckpoint) as e:
        restore_all(ckpt, abstract)
    ckpt.close()
    moved = [p.name for p in (tmp_path / "ckpt").iterdir() if ".damaged-" in p.name]
    assert len(moved) == 1 and moved[0].startswith("4.damaged-"), moved
    assert e.value.moved_to == str(tmp_path / "ckpt" / moved[0])
    lines = [line for line in capsys.readouterr().out.splitlines() if "did not restore" in line]
    assert len(lines) == 1 and f"{tmp_path / 'ckpt'}/4 did not restore (" in lines[0], lines
    assert "resuming from step 2" in lines[0]
    item = kind.split("_")[0]
    assert f"({ {'array': 'state', 'data': 'data', 'meta': 'meta'}[item]}: " in lines[0], lines[0]

    # The next start restores step 2, every item of it, and saves on past the moved step.
    ckpt = Checkpointer(ccfg(tmp_path / "ckpt"))
    resume, meta, states, restored = restore_all(ckpt, abstract)
    assert (resume.step, meta, states) == (2, META, [{"s": 2}])
    assert_tree_equal(restored, host_copy(state))
    ckpt.save(4, state, {"s": 4}, META)
    ckpt.close()
    assert complete_steps(str(tmp_path / "ckpt")) == [2, 4]
    assert (tmp_path / "ckpt" / moved[0]).is_dir()         # never deleted


def test_damaged_step_with_on_damaged_stop_stays_in_place(setup, tmp_path):
    tx, mesh, rules, state = setup
    ckpt = Checkpointer(ccfg(tmp_path / "ckpt"))
    ckpt.save(2, state, {"s": 2}, META)
    ckpt.save(4, state, {"s": 4}, META)
    ckpt.close()
    DAMAGE["array_chunk_truncated"](tmp_path / "ckpt" / "4")
    abstract, _ = step_lib.abstract_train_state(MODEL, tx, mesh, rules)
    ckpt = Checkpointer(ccfg(tmp_path / "ckpt", on_damaged="stop"))
    with pytest.raises(DamagedCheckpoint) as e:
        restore_all(ckpt, abstract)
    ckpt.close()
    assert e.value.moved_to is None
    msg = str(e.value)
    assert "\n" not in msg and "/4 did not restore (state: " in msg and "checkpoint.on_damaged=stop" in msg, msg
    assert complete_steps(str(tmp_path / "ckpt")) == [2, 4]


def test_only_damage_moves_a_step():
    """Errors that say nothing about the files are raised as they are, never a reason to move."""
    assert damage_reason(MemoryError()) is None
    assert damage_reason(Exception("UNAVAILABLE: connection reset by peer")) is None
    assert damage_reason(ValueError("PERMISSION_DENIED: gs://bucket")) is None
    assert damage_reason(RuntimeError("something else")) is None
    # Another optimizer or model than the one saved: the step is fine, the target is not.
    assert damage_reason(ValueError("Requested shape: (2, 128) is not compatible with the stored shape: (4, 128)")) \
        is None
    assert damage_reason(ValueError("User-provided restore item and on-disk value metadata tree structures do not "
                                    "match")) is None
    chunk = Exception("Encountered error while reading array index")
    chunk.__cause__ = ValueError('OUT_OF_RANGE: Error reading "params.w/0.0" [source locations=...]')
    assert damage_reason(chunk) == 'OUT_OF_RANGE: Error reading "params.w/0.0"'
    assert damage_reason(json.JSONDecodeError("Expecting value", "{", 1)).startswith("unparsable JSON")


def test_small_replicated_arrays_are_saved_whole_and_large_ones_split(tmp_path, caplog):
    """MIN_REPLICA_SLICE_BYTES: an array replicated over the 8 devices is written by one replica
    when its per-replica slice would be small (no device slice ops, no compile per shape and
    device at a process's first save), and split across the replicas when large."""
    import logging

    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from model.runtime.checkpoint import MIN_REPLICA_SLICE_BYTES

    replicated = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P())
    rows = -(-MIN_REPLICA_SLICE_BYTES * jax.device_count() // (1032 * 4))       # a slice just over the floor
    small = jax.device_put(np.ones((24, 40), np.float32), replicated)         # shapes no other test saves
    big = jax.device_put(np.ones((rows, 1032), np.float32), replicated)
    ckpt = Checkpointer(ccfg(tmp_path / "ckpt"))
    caplog.set_level(logging.WARNING)
    with jax.log_compiles(True):
        ckpt.save(1, {"params": {"small": small, "big": big}}, DATA_STATE, META)
        ckpt.wait()
    ckpt.close()
    slices = [r.getMessage() for r in caplog.records if "Compiling jit(slice)" in r.getMessage()]
    assert not [m for m in slices if "float32[24,40]" in m], slices
    assert [m for m in slices if f"float32[{rows},1032]" in m], "the large array was not split across its replicas"
    assert (tmp_path / "ckpt" / "1").is_dir()


def test_our_array_handler_registers_without_orbax_warning_line():
    """A start registers our jax.Array handler over Orbax's: that intended override says nothing
    (Orbax would log 'Type handler registry type ... overriding' at every start), while another
    absl warning in the same process still shows."""
    import subprocess
    import sys
    code = ("import logging\nfrom absl import logging as absl_logging\n"
            "from model.runtime.checkpoint import use_array_handler, MIN_REPLICA_SLICE_BYTES\n"
            "import orbax.checkpoint as ocp, jax\n"
            "use_array_handler()\n"
            "h = ocp.type_handlers.get_type_handler(jax.Array)\n"
            "assert h._min_slice_bytes_for_replica_parallel == MIN_REPLICA_SLICE_BYTES\n"
            "absl_logging.warning('a warning of someone else')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr
    assert "overriding" not in r.stderr, r.stderr
    assert "a warning of someone else" in r.stderr, r.stderr
