"""The run's batches, started in one call (`Feed(...)`): a host's iterator from the saved data position behind
the device prefetcher, and data.num_workers=auto's switch of the worker count while the run goes on.

train.py starts the feed before the model restores (worker processes spawn and the first batches
get tokenized meanwhile) and reads it as an iterator of global jax.Arrays. A switch of the worker
count rebuilds the pipeline from the consumed state: the batches do not change (data/host.py). The
old pipeline serves the loop until the new one has caught up (`Handover`), so the new workers'
start (spawn, imports, the windows rebuilt: ~3 s on an H100 host) is not a wait of the loop.
"""
from __future__ import annotations

from data import carried
from data.autoworkers import AutoWorkers, is_auto
from data.config import DataConfig
from data.host import find_shard_states
from data.pipeline import BATCH_KEYS, DevicePrefetcher, make_host_iterator, restore_host_iterator
from data.state import fingerprint


def host_digest(cfg: DataConfig, process_index: int, process_count: int, *, debug: bool, files=None,
                tokenizer=None, data_fingerprint: dict | None = None) -> str:
    """What this host's batches depend on beyond the shard states: a carried next batch is used
    only under the same digest (data/carried.py). data_fingerprint: the run's, when the caller
    has it (train.py); else computed here."""
    if data_fingerprint is None:
        data_fingerprint = fingerprint(cfg, tokenizer=tokenizer, files=files)
    return carried.batch_digest(data_fingerprint, cfg.global_batch_size, process_index, process_count, debug)


def restore_carried(cfg: DataConfig, process_index: int, process_count: int, data_states: list | None,
                    digest: str, **build):
    """(the host iterator from the saved states, whether its first batch is the one the checkpoint
    carried): restore_host_iterator, started after the carried batch when this host has one that
    fits (data/carried.py take)."""
    rows = (cfg.global_batch_size // process_count, cfg.seq_len)
    data_states, head = carried.take(data_states, process_index, process_count, digest,
                                     {k: rows for k in BATCH_KEYS})
    host_iter = restore_host_iterator(cfg, process_index, process_count, data_states, **build)
    if head is None:
        return host_iter, False
    return carried.CarriedBatch(host_iter, head[0], head[1]), True


class Handover:
    """From the prefetcher a switch replaces (`old`) to the one it started (`new`, from the state
    the loop had consumed then): `old` goes on serving the loop while `new` starts, and each batch
    `new` makes of those already served is dropped (its shard states checked against the ones the
    loop got); once `new` has a batch past them ready, it serves and `old` closes.

    Before this, the switch closed `old` and the loop waited for `new`'s first batches: on the lent
    H100 host (BENCHMARKS.md, #38) 38.6% of ten steps' time, once per run. `new` makes the
    batches no slower than the loop needs them (auto picks the count that way), so it catches up;
    should it not within MAX_SERVED batches (a loop waiting on its input already, both pipelines
    as fast), the handover ends by waiting for `new`, as a switch did before."""

    MAX_SERVED = 64

    def __init__(self, old: DevicePrefetcher, new: DevicePrefetcher):
        self.old, self.new = old, new
        self._served = []            # shard states after each batch `old` served that `new` has not made yet
        self._from_old = 0           # batches `old` served since the switch
        self._wait0 = old.stats()["wait_s"]

    def next(self) -> tuple[dict | None, bool]:
        """(a batch for the loop, or None once `new` serves; whether the handover is over)."""
        while self._served and self.new.buffered() > 0:
            self._drop_one()
        if not self._served and self.new.buffered() > 0:
            self._end()
            return None, True
        if self._from_old >= self.MAX_SERVED:
            self.finish()
            return None, True
        batch = next(self.old)
        self._from_old += 1
        self._served.append(find_shard_states(self.old.consumed_state()))
        return batch, False

    def finish(self) -> None:
        """Ends the handover now: waits for `new` to make the batches `old` served."""
        while self._served:
            self._drop_one()
        self._end()

    def _drop_one(self) -> None:
        next(self.new)               # a batch `old` served already
        if find_shard_states(self.new.consumed_state()) != self._served.pop(0):
            raise RuntimeError("the input pipeline of the new worker count made other batches than the one it "
                               "replaces: the data order is not a function of the shard states; please report "
                               "this with the data config")

    def _end(self) -> None:
        # the loop's waits on `old` since the switch are the run's (stats go on from `new`)
        self.new.add_wait(self.old.stats()["wait_s"] - self._wait0)
        self.old.close(background=True)


class Feed:
    """The run's input, started: this host's share of each global batch, as global arrays laid out
    by `sharding`, from `data_states` (every host's saved data position; None: the data's start)
    over `files` (the run's listing). debug: batches keep their document ids
    (train.debug_batches). saved_workers: the worker count a resumed auto run chose before;
    agree: the max over hosts (model/runtime/distributed.py max_over_hosts), so every host
    switches to one count. data_fingerprint: the run's data fingerprint (data/state.py), computed
    here when not given."""

    def __init__(self, cfg: DataConfig, process_index: int, process_count: int, data_states: list | None, *,
                 files, tokenizer, sharding, debug: bool, saved_workers: int | None, agree, announce: bool,
                 data_fingerprint: dict | None = None):
        self._where = (process_index, process_count)
        self._build = dict(debug=debug, files=files, tokenizer=tokenizer)
        self._sharding = sharding
        self.auto = None
        if is_auto(cfg.num_workers):
            # data.num_workers=auto: a provisional count now, the choice after the first steps.
            self.auto = AutoWorkers(cfg, process_count, files, saved=saved_workers, agree=agree)
            cfg = self.auto.cfg
            if announce:
                print(self.auto.announce(), flush=True)
        self.cfg = cfg
        self._announce = announce
        self._replaced = []          # prefetchers a switch replaced, closing in the background
        self._handover = None        # a switch's old pipeline still serving (Handover)
        self._digest = host_digest(cfg, process_index, process_count, debug=debug, files=files, tokenizer=tokenizer,
                                   data_fingerprint=data_fingerprint)
        # carried: the first batch came with the checkpoint (nothing tokenized before it)
        host_iter, self.carried = restore_carried(cfg, process_index, process_count, data_states, self._digest,
                                                  **self._build)
        self.prefetcher = DevicePrefetcher(host_iter, sharding, prefetch=cfg.prefetch)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._handover is not None:
            batch, over = self._handover.next()
            if not over:
                return batch
            self._handover = None
        return next(self.prefetcher)

    @property
    def _serving(self) -> DevicePrefetcher:
        """The prefetcher whose batches the loop has: the old one during a handover."""
        return self._handover.old if self._handover is not None else self.prefetcher

    @property
    def num_workers(self) -> int:
        return self.cfg.num_workers

    def stats(self) -> dict:
        return self._serving.stats()

    def consumed_state(self) -> dict:
        return self._serving.consumed_state()

    def saved_state(self) -> dict:
        """The state a checkpoint saves: the consumed state and, with data.carry_next_batch, the
        next batch when it is made already (data/carried.py; a save never waits for it)."""
        state = self.consumed_state()
        if not self.cfg.carry_next_batch or self._handover is not None:
            return state
        ready = self.prefetcher.ready_next()
        if ready is None:
            return state
        return carried.with_next(state, self._digest, *ready)

    def compiled(self, step: int, paused_s: float) -> None:
        """The compiling step is done: auto's measurement starts here."""
        if self.auto is not None:
            self.auto.start(step, self.stats()["wait_s"], paused_s)

    def switch_due(self, step: int) -> bool:
        return self.auto is not None and self.auto.due(step)

    def switch(self, step: int, paused_s: float) -> dict:
        """data.num_workers=auto's choice, made after its measured steps have run: the pipeline
        moves to the chosen count (when it differs). Returns the figures for the next metrics row."""
        if self._handover is not None:       # the last switch's handover still on: finish it first
            self._handover.finish()
            self._handover = None
        prefetcher, row = self.auto.switch(self.prefetcher, step, paused_s, restart=self._restart,
                                           announce=self._announce)
        if prefetcher is not self.prefetcher:
            self._replaced.append(self.prefetcher)
            self._handover = Handover(self.prefetcher, prefetcher)
            self.prefetcher = prefetcher
        self.cfg = self.auto.cfg
        return row

    def _restart(self, cfg: DataConfig, shard_states, follows: DevicePrefetcher) -> DevicePrefetcher:
        """The same batches from the consumed `shard_states` with another worker count."""
        host_iter = make_host_iterator(cfg, *self._where, shard_states, **self._build)
        return DevicePrefetcher(host_iter, self._sharding, prefetch=cfg.prefetch, follows=follows)

    def close(self) -> None:
        for p in [self.prefetcher, *self._replaced]:
            p.close()
