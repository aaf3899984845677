"""The fast local checkpoint tier (checkpoint.local_dir, checkpoint.local_every, checkpoint.local_keep).

Beside the durable checkpoints (checkpoint.dir, every `checkpoint.every` steps, on a bucket) a
run may keep frequent ones on each host's own disk or /dev/shm: every `local_every` steps each
host writes the shards of the train state it holds, its data position and the run's meta to
`<local_dir>/<run>/p<i>/<step>/`. No host reads another's files and no save is collective, so a local
save costs the device-to-host copy of this host's shards; the write goes on in a thread. The
steps live under a directory named after the run's durable `checkpoint.dir` (its name and a
hash of its path), so runs sharing one local_dir never take each other's steps.

Files of a step (arrays and JSON, never pickles), written under `.tmp-<step>` and renamed when
complete: `arrays.bin` (every shard's bytes, back to back), `manifest.json` (per leaf: shape,
dtype, and per shard its index and place in arrays.bin), `data.json` (this host's data state),
`meta.json`.

On a start, every host names the local steps it can restore into the current layout (the same
shard indices on its devices) and the hosts agree on the newest step all of them hold
(`pick`); it wins when it is newer than the newest durable step. A host that lost its local
tier (a recreated VM) or a changed mesh makes every host take the durable tier together. The
data states are exchanged once (every host's, as the durable data item holds them), so the
input pipeline restores as from a durable step.

Damaged local steps fall back like durable ones (model/runtime/checkpoint.py): a step whose
manifest.json does not parse or whose arrays.bin is missing or shorter than the manifest's last
shard end (a stat, no array is read) is found before the agreement; a meta.json or data.json that
does not parse, after it, when each host reads the agreed step's (no other step's is read). Each
host names its damaged step in one line and moves it aside (`<step>.damaged-<UTC time>` beside
it, never deleted; no longer a step), and the hosts agree on the newest step all of them still
hold, or on the durable tier. Every host makes the same gathers: a retry follows only what the
gather told every host alike.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from data import carried

SOURCE = "local"
NEXT_BATCH_FILE = "next_batch.npz"      # this host's next batch, when the save carried one


def run_key(durable_dir: str) -> str:
    """The run's directory name inside local_dir: the durable dir's parent's name and a hash."""
    import hashlib

    path = str(durable_dir).rstrip("/")
    name = path.rsplit("/", 2)[-2] if path.count("/") >= 1 else path
    return f"{name or 'run'}-{hashlib.sha1(path.encode()).hexdigest()[:10]}"


def _index_key(index, shape) -> str:
    """A shard's index (tuple of slices) as text: 'start:stop,start:stop'."""
    parts = []
    for sl, dim in zip(index, shape, strict=True):
        start, stop, _ = sl.indices(dim)
        parts.append(f"{start}:{stop}")
    return ",".join(parts)


def _leaves(tree):
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in flat]


def _wanted(abstract_state) -> dict[str, set[str]]:
    """Per leaf, the shard indices this host's devices hold in the current layout."""
    out = {}
    for name, leaf in _leaves(abstract_state):
        idx = leaf.sharding.addressable_devices_indices_map(leaf.shape)
        out[name] = {_index_key(i, leaf.shape) for i in idx.values()}
    return out


@dataclasses.dataclass
class LocalPick:
    step: int
    meta: dict
    data_states: list[dict]          # every host's, in process order
    directory: str                   # this host's step directory


class LocalTier:
    def __init__(self, local_dir: str, every: int, keep: int, *, process_index: int, run: str = ""):
        self.root = Path(local_dir) / run / f"p{process_index}"
        self.process_index = process_index
        self.every, self.keep = int(every), int(keep)
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None

    @classmethod
    def from_config(cls, ccfg, process_index: int) -> LocalTier | None:
        local_dir = ccfg.get("local_dir")
        if not local_dir:
            return None
        durable = str(ccfg["dir"])
        if "://" not in durable:
            import os

            durable = os.path.abspath(durable)
        return cls(str(local_dir), int(ccfg.get("local_every") or 0), int(ccfg.get("local_keep") or 2),
                   process_index=process_index, run=run_key(durable))

    @staticmethod
    def check_settings(ccfg) -> None:
        if not ccfg.get("local_dir"):
            return
        if "://" in str(ccfg["local_dir"]):
            raise ValueError(f"checkpoint.local_dir={ccfg['local_dir']}: a host's own disk or /dev/shm, not a URL "
                             "(the durable tier is checkpoint.dir)")
        if not int(ccfg.get("local_every") or 0) > 0:
            raise ValueError(f"checkpoint.local_every={ccfg.get('local_every')} must be positive with "
                             "checkpoint.local_dir")
        if not int(ccfg.get("local_keep") or 0) > 0:
            raise ValueError(f"checkpoint.local_keep={ccfg.get('local_keep')} must be positive")

    # ---------------------------------------------------------------- what is there
    def steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(p.name) for p in self.root.iterdir() if p.name.isdigit() and (p / "meta.json").is_file())

    def _check(self, step: int, wanted: dict[str, set[str]]) -> tuple[bool, str | None]:
        """(restores into the current layout, why the step is damaged or None), from its
        manifest and the size of arrays.bin (a stat: no array is read)."""
        d = self.root / str(step)
        try:
            leaves = json.loads((d / "manifest.json").read_text())["leaves"]
            shards = {k: [(s["index"], s["offset"] + s["nbytes"]) for s in v["shards"]] for k, v in leaves.items()}
        except FileNotFoundError:
            return False, "manifest.json: missing"
        except (ValueError, KeyError, TypeError, AttributeError) as e:    # JSONDecodeError, UnicodeDecodeError
            return False, f"manifest.json: {type(e).__name__}: {e}"
        except OSError:
            return False, None
        if set(shards) != set(wanted) or not all(wanted[k] <= {i for i, _ in shards[k]} for k in wanted):
            return False, None          # another layout: not damaged, just not this start's
        need = max((end for v in shards.values() for _, end in v), default=0)
        try:
            size = (d / "arrays.bin").stat().st_size
        except FileNotFoundError:
            return False, "arrays.bin: missing"
        if size < need:
            return False, f"arrays.bin: {size} bytes, the manifest needs {need}"
        return True, None

    def _move_aside(self, step: int, reason: str) -> None:
        """Names damaged `step` in one line and renames it `<step>.damaged-<UTC time>`."""
        d = self.root / str(step)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        target, n = self.root / f"{step}.damaged-{stamp}", 1
        while target.exists():
            target, n = self.root / f"{step}.damaged-{stamp}-{n}", n + 1
        try:
            d.rename(target)
            moved = f"moved aside to {target}"
        except OSError as e:
            moved = f"left in place, not moved aside ({e})"
        print(f"local checkpoint {d} did not restore ({reason}); {moved}", flush=True)

    def _read_json(self, step: int, name: str) -> tuple[object, str | None]:
        try:
            return json.loads((self.root / str(step) / name).read_text()), None
        except FileNotFoundError:
            return None, f"{name}: missing"
        except ValueError as e:          # JSONDecodeError, UnicodeDecodeError
            return None, f"{name}: {type(e).__name__}: {e}"

    def pick(self, abstract_state, *, newer_than: int | None, gather: Callable[[object], list]) -> LocalPick | None:
        """The newest local step every host can restore, when newer than `newer_than` (the
        newest durable step); every process must call it (two small all-gathers, one more per
        step found damaged on some host). A damaged step is moved aside (module docstring)."""
        wanted = _wanted(abstract_state)
        mine = []
        for s in self.steps():
            if newer_than is not None and s <= newer_than:
                continue                # never picked: its files are not read
            fits, damage = self._check(s, wanted)
            if damage is not None:
                self._move_aside(s, damage)
            elif fits:
                mine.append(s)
        common = set(mine)
        for theirs in gather(mine):
            common &= set(theirs)
        # The agreed step's meta and data states; a step some host finds damaged there is left out
        # on every host (all of them saw it in the gather) and the next common step is tried.
        for step in sorted(common, reverse=True):
            meta, damage = self._read_json(step, "meta.json")
            data = None
            if damage is None:
                data, damage = self._read_json(step, "data.json")
            if damage is not None:
                self._move_aside(step, damage)
            # every host's state but not its next batch's arrays: those are its own (data/carried.py)
            got = gather({"damaged": damage is not None, "data": data})
            if not any(g["damaged"] for g in got):
                states = [carried.drop_next(g["data"]) for g in got]
                states[self.process_index] = carried.attach_arrays(
                    data, (self.root / str(step) / NEXT_BATCH_FILE).read_bytes)
                return LocalPick(step, meta, states, str(self.root / str(step)))
        return None

    # ---------------------------------------------------------------- save
    def should_save(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, state, data_state: dict, meta: dict) -> None:
        """Copies this host's shards off the devices (the blocked part) and writes them in a
        thread; a save still writing is waited for first."""
        self.wait()
        shards, manifest = [], {}
        offset = 0
        picked = []
        for name, leaf in _leaves(state):
            seen, mine = set(), []
            for shard in leaf.addressable_shards:
                key = _index_key(shard.index, leaf.shape)
                if key not in seen:
                    seen.add(key)
                    shard.data.copy_to_host_async()         # every transfer in flight before the first wait
                    mine.append((key, shard.data))
            picked.append((name, leaf, mine))
        for name, leaf, mine in picked:
            entries = []
            for key, data in mine:
                # The host copy (on CPU a view of the buffer: a buffer with a host view is never
                # reused by the next step's donation, so it stays as saved until written).
                host = np.asarray(data)
                entries.append({"index": key, "offset": offset, "nbytes": host.nbytes, "shape": list(host.shape)})
                shards.append(host)
                offset += host.nbytes
            manifest[name] = {"shape": list(leaf.shape), "dtype": str(leaf.dtype), "shards": entries}
        payload = {"leaves": manifest, "step": step}
        self._writer = threading.Thread(target=self._write, args=(step, shards, payload, data_state, meta),
                                        name="local-checkpoint", daemon=True)
        self._writer.start()

    def _write(self, step, shards, manifest, data_state, meta) -> None:
        try:
            tmp = self.root / f".tmp-{step}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            with open(tmp / "arrays.bin", "wb") as f:
                for a in shards:
                    f.write(memoryview(a.reshape(-1).view(np.uint8)))
            (tmp / "manifest.json").write_text(json.dumps(manifest))
            data_state, next_batch = carried.split_arrays(data_state)
            if next_batch is not None:      # this host's next batch (data/carried.py)
                (tmp / NEXT_BATCH_FILE).write_bytes(next_batch)
            (tmp / "data.json").write_text(json.dumps(data_state))
            (tmp / "meta.json").write_text(json.dumps(meta))      # last: marks the step complete
            final = self.root / str(step)
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            for old in self.steps()[:-self.keep]:
                shutil.rmtree(self.root / str(old), ignore_errors=True)
        except BaseException as e:  # noqa: BLE001 - raised on the main thread by wait()
            self._error = e

    def wait(self) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            e, self._error = self._error, None
            raise RuntimeError(f"local checkpoint in {self.root} failed: {e}") from e

    def drop_after(self, step: int) -> None:
        """Local steps after `step` belong to a timeline rolled back (model/runtime/rollback.py)."""
        self.wait()
        for s in self.steps():
            if s > step:
                shutil.rmtree(self.root / str(s), ignore_errors=True)

    # ---------------------------------------------------------------- restore
    def restore(self, step: int, abstract_state):
        """The train state of local `step`, straight onto this host's devices."""
        import jax
        import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy

        d = self.root / str(step)
        manifest = json.loads((d / "manifest.json").read_text())["leaves"]
        raw = np.memmap(d / "arrays.bin", dtype=np.uint8, mode="r")
        flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
        out = []
        for path, leaf in flat:
            entry = manifest[jax.tree_util.keystr(path)]
            by_index = {s["index"]: s for s in entry["shards"]}
            dtype = np.dtype(leaf.dtype)
            arrays = []
            for device, index in leaf.sharding.addressable_devices_indices_map(leaf.shape).items():
                s = by_index[_index_key(index, leaf.shape)]
                host = np.array(raw[s["offset"]:s["offset"] + s["nbytes"]]).view(dtype).reshape(s["shape"])
                arrays.append(jax.device_put(host, device))
            out.append(jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, arrays))
        return jax.tree_util.tree_unflatten(treedef, out)
