"""The "continue from an open checkpoint" journey with gs:// everywhere, as a user runs it, against
a local GCS emulator (tests/gcs_emulator.py): a Llama 3 directory (transformers' own classes,
rope_scaling llama3, with its tokenizer) -> scripts/import_hf.py to gs:// -> train.py a few
steps with checkpoint.init_from and checkpoint.dir on gs:// (the overrides import_hf printed) ->
scripts/export_hf.py from gs:// to a local directory (its defaults: bf16, hub-style files) ->
transformers' LlamaForCausalLM loads it and gives our logits. Nothing lands on local disk under
a "gs:" directory.

    pytest -n0 tests/test_hf_continue_gcs.py -q      (skips without the emulator, torch or transformers)
"""
import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gcp_storage_emulator.server")
from tests.gcs_emulator import BUCKET, Emulator  # noqa: E402  (sets gcsfs's env before it loads)

gcsfs = pytest.importorskip("gcsfs")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "data" / "sample" / "tokenizer.json"
RUN = ["data.seq_len=64", "data.global_batch_size=8", "data.num_workers=0", "train.log_every=1",
       "train.eval_every=0", "checkpoint.every=0", "optimizer.warmup_steps=1", "logger.wandb.mode=disabled",
       "logger.progress_bar=false"]


def _run(args, env, cwd):
    r = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r.stdout


def test_import_train_export_all_on_gs(tmp_path):
    pytest.importorskip("torch")            # before anything imports torch (hf_helpers does)
    pytest.importorskip("transformers")
    import hf_helpers
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import torch
    import transformers

    from model.runtime import checkpoint as ckpt_lib
    from model.step import model_from_params

    em = Emulator(generations=True)          # as real GCS: what TensorStore (Orbax's arrays) needs
    mp = pytest.MonkeyPatch()
    try:
        em.connect(mp)
        for key, value in em.env().items():  # this process reads the bucket too (our logits)
            mp.setenv(key, value)
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        hf_dir = tmp_path / "Llama-3-tiny"
        hf_helpers.save_variant("llama3", hf_dir, vocab_size=4096)    # the bundled tokenizer's ids
        shutil.copy(TOKENIZER, hf_dir / "tokenizer.json")
        imported, ckpt_dir = f"gs://{BUCKET}/imports/llama3", f"gs://{BUCKET}/runs/cont/checkpoints"

        # 1. import to the bucket; it prints the train.py command to continue with
        printed = _run([ROOT / "scripts" / "import_hf.py", hf_dir, imported], env, tmp_path)
        command = next(line for line in printed.splitlines() if line.startswith("python train.py "))
        overrides = shlex.split(command)[2:]
        assert f"checkpoint.init_from={imported}" in overrides and "model.rope_type=llama3" in overrides
        fs = gcsfs.GCSFileSystem(token="anon", project="test")
        fs.invalidate_cache()
        assert f"{BUCKET}/imports/llama3/0/commit_success.txt" in fs.find(f"{BUCKET}/imports/llama3")

        # 2. a few steps from it, its checkpoints on the bucket too
        out = _run([ROOT / "train.py", f"hydra.run.dir={tmp_path / 'run'}", *overrides, *RUN, "train.steps=3",
                    f"checkpoint.dir={ckpt_dir}"], env, tmp_path)
        assert f"Initialised parameters from {imported}; starting at step 0" in out, out[-2000:]
        fs.invalidate_cache()
        assert fs.ls(ckpt_dir.removeprefix("gs://")) == [f"{BUCKET}/runs/cont/checkpoints/3"]

        # 3. export from the bucket, with the defaults a user gets
        _run([ROOT / "scripts" / "export_hf.py", ckpt_dir, tmp_path / "out"], env, tmp_path)
        assert not list(tmp_path.rglob("gs:*")), "a gs:// path was written to local disk"

        # it trained from the imported weights (close to them, not a fresh init's far-off values)
        cfg, trained, meta = ckpt_lib.load_params(ckpt_dir, host=True)
        _, start, _ = ckpt_lib.load_params(imported, host=True)
        assert meta["step"] == 3 and cfg.rope_type == "llama3"
        moved = np.abs(trained["embed_vd"] - start["embed_vd"]).max()
        assert 0 < moved < 0.05, moved

        model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32,
                                                              attn_implementation="eager").eval()
        assert model.config.rope_scaling["rope_type"] == "llama3"
        tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40))
        with torch.no_grad():
            want = model(torch.from_numpy(tokens)).logits.numpy()
        # ours in fp32 on the weights as exported (bf16)
        as_bf16 = jax.tree.map(lambda w: np.asarray(w).astype(ml_dtypes.bfloat16).astype(np.float32), trained)
        b, t = tokens.shape
        got = np.asarray(model_from_params(dataclasses.replace(cfg, dtype="float32"), as_bf16)(
            jnp.asarray(tokens, jnp.int32), jnp.broadcast_to(jnp.arange(t), (b, t)), jnp.ones((b, t), jnp.int32)))
        assert np.abs(want).max() > 1.0
        assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()
    finally:
        gcsfs.GCSFileSystem.clear_instance_cache()
        mp.undo()
        em.stop()
