"""The input pipeline for a PyTorch loop: `Batches`, this rank's share of every global batch as
torch tensors, with the pipeline's exact and elastic resume.

    from data.torch import Batches
    batches = Batches(["data.paths=/data/*.json", "data.text_key=story", "tokenizer.path=gpt2.json"])
    for step, batch in zip(range(steps), batches):      # batch["input_ids"]: [global_batch / world, seq_len]
        ...

A thin face over the JAX run's own input: the same Hydra config (configs/, the overrides train.py
takes), the same listing, held-out split and checks, and the same host iterator
(data/pipeline.py make_host_iterator) with a PyTorch rank in the role of a JAX process. The
global batch layout is fixed (data/host.py), so rank r of W gets exactly the rows that host r of
W processes trains on, and a state saved at one world size resumes at another
(data/state.py merge_host_states). What is not here: the device prefetcher (a JAX thing; a
PyTorch loop copies with `.to(device, non_blocking=True)`, from pinned memory on request).

JAX: importing this module imports neither Grain nor JAX. The pipeline imports Grain, and Grain
imports JAX's profiler when JAX is installed (a dependency of this project), but nothing here
starts a JAX backend: no device is touched and no accelerator memory is taken.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import os
import warnings
import weakref
from pathlib import Path

import numpy as np
import torch
import torch.utils.data

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
# Targets that take no loss (padding, and the token after a document's end: the next document's
# first token) hold this: torch.nn.functional.cross_entropy's default ignore_index.
IGNORE_INDEX = -100
STATE_KIND = "jaxpt.data.torch"


# Composed configs by their overrides, unresolved: Hydra's composition of configs/train.yaml takes
# ~0.6 s of CPU, and a loop builds a Batches per rank, per resume, per world size from the same
# overrides. Each call still returns its own config (a fresh copy, struct mode on as Hydra gives it).
_COMPOSED: dict[tuple, dict] = {}


def compose(overrides=()):
    """The run config train.py would compose from these Hydra overrides (configs/train.yaml)."""
    from omegaconf import OmegaConf

    key = tuple(str(o) for o in overrides)
    if key not in _COMPOSED:
        _COMPOSED[key] = OmegaConf.to_container(_hydra_compose(list(key)), resolve=False)
    cfg = OmegaConf.create(_COMPOSED[key])
    OmegaConf.set_struct(cfg, True)
    return cfg


def _hydra_compose(overrides: list):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not OmegaConf.has_resolver("project_root"):     # as train.py defines it
        OmegaConf.register_new_resolver("project_root", lambda: str(CONFIG_DIR.parent))
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            return hydra_compose(config_name="train", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise ValueError(f"config overrides {overrides}: {e}".replace("\n", " ")) from None


def world_of(rank: int | None, world: int | None) -> tuple[int, int]:
    """(rank, world): given, else torch.distributed's when it is initialised, else (0, 1)."""
    if rank is None and world is None:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    if rank is None or world is None:
        raise ValueError(f"Batches: give both rank and world, or neither (got rank={rank}, world={world})")
    if not 0 <= rank < world:
        raise ValueError(f"Batches: rank={rank} is not in 0..{world - 1} (world={world})")
    return int(rank), int(world)


def _from_rank_0(make):
    """make()'s JSON result computed on rank 0 and sent to every rank (its ValueError raised on
    every rank), as model/runtime/distributed.py from_process_0 does for JAX processes: a bucket
    is listed once, not once per rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return make()
    box = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = json.dumps({"ok": make()})
        except ValueError as e:
            box[0] = json.dumps({"error": str(e)})
    dist.broadcast_object_list(box, src=0)
    got = json.loads(box[0])
    if "error" in got:
        raise ValueError(got["error"])
    return got["ok"]


@dataclasses.dataclass
class Input:
    """What a rank's pipeline is built from, as train.py builds it: the training DataConfig (a
    resolved worker count), its files (the held-out ones removed) and the loaded tokenizer."""
    cfg: object
    files: list | dict
    tokenizer: object


def input_from_config(cfg, world: int, *, list_once: bool) -> Input:
    """The config checks, the listing and the held-out split of train.py, for `world` ranks.
    list_once: rank 0 lists and sends the list to the others (torch.distributed)."""
    from omegaconf import OmegaConf

    import data as data_lib
    from data.autoworkers import provisional_workers, ram_budget_bytes
    from data.tokenizer import available_cores

    data_cfg, eval_paths, holdout = data_lib.data_settings(OmegaConf.to_container(cfg.data, resolve=True),
                                                           cfg.tokenizer.path)
    data_lib.validate_settings(data_cfg, world)
    if data_lib.is_auto(data_cfg.num_workers):
        # No train step to measure here: auto takes the count the JAX run starts with, from
        # this rank's share of the machine's cores (torchrun sets LOCAL_WORLD_SIZE).
        cores = max(1, available_cores() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        data_cfg = dataclasses.replace(data_cfg, num_workers=provisional_workers(
            data_cfg.num_shards // world, cores, ram_budget_bytes(data_cfg.ram_budget_gb)))
    tokenizer = data_lib.load_tokenizer(data_cfg.tokenizer)
    listing = data_lib.run_listing(data_cfg.patterns(), eval_paths, None, log=lambda _line: None,
                                   from_process_0=_from_rank_0 if list_once else lambda make: make())
    data_cfg, _, train_files, _ = data_lib.split_eval(data_cfg, listing, holdout)
    data_lib.check_files(data_cfg, world, train_files, tokenizer=tokenizer)
    return Input(data_cfg, train_files, tokenizer)


def to_torch(batch: dict, pin: bool) -> dict:
    """A host batch (int32 numpy, data/workers.py slab_to_batch) -> PyTorch's conventions: int64
    `input_ids`, `labels` (the next token, IGNORE_INDEX where no loss is taken), `segment_ids`
    (1, 2, ... per packed document, 0 = padding) and `positions` (from 0 in each document)."""
    labels = np.where(batch["loss_mask"] > 0, batch["targets"], IGNORE_INDEX)
    out = {"input_ids": batch["inputs"], "labels": labels, "segment_ids": batch["segment_ids"],
           "positions": batch["positions"]}
    out = {k: torch.from_numpy(np.asarray(v, np.int64)) for k, v in out.items()}
    for k in ("doc_ids", "row_shard"):          # debug=True only
        if k in batch:
            out[k] = torch.from_numpy(np.asarray(batch[k]))
    if pin:
        out = {k: v.pin_memory() for k, v in out.items()}
    return out


class Batches(torch.utils.data.IterableDataset):
    """This rank's rows of every global batch of the run `overrides` configure, as a dict of
    int64 tensors `input_ids`, `labels`, `segment_ids`, `positions`, each
    [data.global_batch_size / world, data.seq_len] (to_torch says what they hold). An endless
    stream (epochs follow each other, reshuffled): take the steps you train.

    overrides: Hydra overrides of configs/train.yaml, as train.py takes them (only the data.* and
    tokenizer.* settings matter here), or an already composed config. rank, world: this process's
    place; None: torch.distributed's when it is initialised, else 0 of 1. pin_memory: tensors in
    page-locked memory for asynchronous copies to an accelerator (ignored, with a warning, where
    there is none, as torch's DataLoader does). debug: adds `doc_ids` and `row_shard` (tests).

    Reading and tokenizing run in the pipeline's own worker processes (data.num_workers), which
    read ahead; so `DataLoader(Batches(...), batch_size=None)` needs no DataLoader workers (and
    refuses them: each would read the same rows). Its iterator is itself: iterating again goes on
    where it stopped. state_dict / load_state_dict follow torchdata's Stateful protocol."""

    def __init__(self, overrides=(), rank: int | None = None, world: int | None = None, *,
                 pin_memory: bool = False, debug: bool = False):
        super().__init__()
        from_dist = rank is None and world is None
        self.rank, self.world = world_of(rank, world)
        cfg = overrides if hasattr(overrides, "data") else compose(overrides)
        self._input = input_from_config(cfg, self.world, list_once=from_dist)
        self.cfg = self._input.cfg          # the training DataConfig (worker count resolved)
        self.files = self._input.files      # its files (held-out ones removed)
        self.vocab_size = self._input.tokenizer.get_vocab_size()
        self.debug = debug
        self.pin_memory = pin_memory and _can_pin()
        self._fingerprint = None
        self._it = None               # the host iterator, built at the first batch or state_dict
        self._restore = None          # ("shards", {shard: state}) or ("hosts", [host states])
        self._base_state = None       # where stats() count from

    # ---------------------------------------------------------------- iteration
    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        if info is not None:
            raise RuntimeError(f"Batches in a DataLoader worker process ({info.num_workers} workers): each "
                               "would read the same rows. Use DataLoader(batches, batch_size=None, "
                               "num_workers=0); data.num_workers sets the pipeline's own reader processes")
        return self

    def __next__(self) -> dict:
        return to_torch(next(self._iterator()), self.pin_memory)

    def _iterator(self):
        if self._it is None:
            from data.pipeline import make_host_iterator, restore_host_iterator

            inp = self._input
            kw = dict(debug=self.debug, files=inp.files, tokenizer=inp.tokenizer)
            kind, saved = self._restore or ("shards", None)
            if kind == "hosts":
                self._it = restore_host_iterator(inp.cfg, self.rank, self.world, saved, **kw)
            else:
                self._it = make_host_iterator(inp.cfg, self.rank, self.world, saved, **kw)
            if self._base_state is None:
                self._base_state = self._it.get_state()
            _OPEN.add(self)
        return self._it

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """The position after the last batch returned (JSON: the host state a checkpoint saves,
        with the data fingerprint it is checked against, and this rank's place)."""
        return {"kind": STATE_KIND, "rank": self.rank, "world": self.world,
                "global_batch_size": self.cfg.global_batch_size,
                "fingerprint": self._data_fingerprint(), "data": self._iterator().get_state()}

    def load_state_dict(self, state) -> None:
        """Continue from a saved position: this rank's own state_dict() (the same world), or
        the list of every old rank's state_dict() when the world changed (the rows of any
        rank then continue as an uninterrupted run's would). A DataLoader's state_dict()
        holding one (torchdata's StatefulDataLoader) does as well. The next batch is built
        from it."""
        if isinstance(state, (list, tuple)) and state:
            states = [_find_state(s) for s in state]
        elif isinstance(state, dict):
            states = [_find_state(state)]
        else:
            raise ValueError("Batches.load_state_dict: expected a state_dict() or a list of every rank's "
                             f"state_dict(), got {type(state).__name__}")
        saved_lens = {self._check_state(s) for s in states}
        if isinstance(state, dict):
            restore = ("shards", self._own_shards(states[0]))
        else:
            worlds = sorted({int(s["world"]) for s in states})
            ranks = sorted(int(s["rank"]) for s in states)
            if len(worlds) != 1 or ranks != list(range(worlds[0])):
                raise ValueError(f"Batches.load_state_dict: states of ranks {ranks} of world(s) {worlds}; a world "
                                 "change needs the state of every old rank, one each")
            restore = ("hosts", [s["data"] for s in sorted(states, key=lambda s: int(s["rank"]))])
        saved_len = saved_lens.pop() if len(saved_lens) == 1 else None
        if saved_len is not None:       # data.shape_change=continue: saved at another seq_len
            from data.resume import continue_at_length, mark_length

            restore = (("shards", mark_length(restore[1], saved_len)) if restore[0] == "shards"
                       else ("hosts", continue_at_length(restore[1], saved_len)))
        self.close()
        self._restore = restore
        self._base_state = None

    def _check_state(self, state) -> int | None:
        """Refuses a state this config cannot continue (one line naming the setting); returns the
        seq_len it was saved at when data.shape_change=continue continues it at another one."""
        from data.resume import plan_resume

        now = self._data_fingerprint()
        plan = plan_resume(state["fingerprint"], now, mixture_change=self.cfg.mixture_change,
                           allow_data_change=False, shape_change=self.cfg.shape_change)
        for key in sorted(set(plan.fingerprint) | set(state["fingerprint"])):
            was, is_ = state["fingerprint"].get(key, "<absent>"), plan.fingerprint.get(key, "<absent>")
            if f"data.{key}" not in plan.accepted and json.dumps(was) != json.dumps(is_):
                raise ValueError(f"Batches.load_state_dict: the saved position was read with data.{key}={was!r}, "
                                 f"this config has {is_!r}" + (f" ({plan.hint})" if plan.hint else ""))
        batch = state.get("global_batch_size")
        if batch is not None and int(batch) != self.cfg.global_batch_size and self.cfg.shape_change != "continue":
            raise ValueError(f"Batches.load_state_dict: the saved position was read with data.global_batch_size="
                             f"{batch}, this config has {self.cfg.global_batch_size} (set data.shape_change=continue "
                             "to continue it at this batch)")
        return plan.saved_seq_len

    def _own_shards(self, state: dict) -> dict:
        """This rank's shards' states from its own saved state (same world)."""
        from data.host import find_shard_states
        from data.pipeline import host_shards

        if int(state["world"]) != self.world or int(state["rank"]) != self.rank:
            raise ValueError(f"Batches.load_state_dict: a state of rank {state['rank']} of world {state['world']} "
                             f"given to rank {self.rank} of world {self.world}: pass each rank its own state, or "
                             "after a world change the list of every old rank's state")
        found = find_shard_states(state["data"])
        missing = [v for v in host_shards(self.cfg.num_shards, self.rank, self.world) if str(v) not in found]
        if missing:
            raise ValueError(f"Batches.load_state_dict: the state lacks virtual shards {missing} of rank {self.rank}")
        return found

    def _data_fingerprint(self) -> dict:
        if self._fingerprint is None:
            from data.state import fingerprint

            self._fingerprint = fingerprint(self.cfg, tokenizer=self._input.tokenizer, files=self._input.files)
        return self._fingerprint

    # ---------------------------------------------------------------- figures and the end
    def stats(self) -> dict:
        """What this rank's batches held since this object started or last loaded a state (as the
        training log counts them): documents, tokens, rows, padding, bad records by kind with
        their first examples (file:line), a mixture's per-source figures."""
        from data.pipeline import consumed_figures

        it = self._iterator()
        return consumed_figures(it.get_state(), self._base_state)

    def close(self) -> None:
        """Stops the pipeline's worker processes (a later batch starts them again, from the
        position reached; stats() go on counting)."""
        if self._it is not None:
            self._restore = ("shards", _shards_of(self._it.get_state()))
            close = getattr(self._it, "close", None)
            self._it = None
            if close is not None:
                close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# Pipelines still open when the interpreter exits are closed first: a host iterator left to the
# garbage collector at shutdown closes its tokenizer pool after its modules are torn down.
_OPEN: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_open() -> None:
    for batches in list(_OPEN):
        batches.close()


def _find_state(state) -> dict:
    """The Batches state in `state` (itself, or nested in a DataLoader's state_dict())."""
    def walk(x):
        if isinstance(x, dict):
            if x.get("kind") == STATE_KIND:
                return x
            x = list(x.values())
        if isinstance(x, (list, tuple)):
            for v in x:
                if (found := walk(v)) is not None:
                    return found
        return None
    found = walk(state)
    if found is None:
        raise ValueError(f"Batches.load_state_dict: no Batches.state_dict() (kind {STATE_KIND!r}) in the given state")
    return found


def _shards_of(host_state: dict) -> dict:
    from data.host import find_shard_states

    return find_shard_states(host_state)


def _can_pin() -> bool:
    if torch.accelerator.is_available():
        return True
    warnings.warn("Batches(pin_memory=True): no accelerator is available, so memory is not pinned", stacklevel=3)
    return False
