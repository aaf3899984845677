"""The run's batches, started in one call (`Feed(...)`): a host's iterator from the saved data position behind
the device prefetcher, and data.num_workers=auto's switch of the worker count while the run goes on.

train.py starts the feed before the model restores (worker processes spawn and the first batches
get tokenized meanwhile) and reads it as an iterator of global jax.Arrays. A switch of the worker
count rebuilds the pipeline from the consumed state: the batches do not change (data/host.py).
"""
from __future__ import annotations

from data.autoworkers import AutoWorkers, is_auto
from data.config import DataConfig
from data.pipeline import DevicePrefetcher, make_host_iterator, restore_host_iterator


class Feed:
    """The run's input, started: this host's share of each global batch, as global arrays laid out
    by `sharding`, from `data_states` (every host's saved data position; None: the data's start)
    over `files` (the run's listing). debug: batches keep their document ids
    (train.debug_batches). saved_workers: the worker count a resumed auto run chose before;
    agree: the max over hosts (model/runtime/distributed.py max_over_hosts), so every host
    switches to one count."""

    def __init__(self, cfg: DataConfig, process_index: int, process_count: int, data_states: list | None, *,
                 files, tokenizer, sharding, debug: bool, saved_workers: int | None, agree, announce: bool):
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
        self.prefetcher = DevicePrefetcher(restore_host_iterator(cfg, *self._where, data_states, **self._build),
                                           sharding, prefetch=cfg.prefetch)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        return next(self.prefetcher)

    @property
    def num_workers(self) -> int:
        return self.cfg.num_workers

    def stats(self) -> dict:
        return self.prefetcher.stats()

    def consumed_state(self) -> dict:
        return self.prefetcher.consumed_state()

    def compiled(self, step: int, paused_s: float) -> None:
        """The compiling step is done: auto's measurement starts here."""
        if self.auto is not None:
            self.auto.start(step, self.stats()["wait_s"], paused_s)

    def switch_due(self, step: int) -> bool:
        return self.auto is not None and self.auto.due(step)

    def switch(self, step: int, paused_s: float) -> dict:
        """data.num_workers=auto's choice, made after its measured steps have run: the pipeline
        moves to the chosen count (when it differs). Returns the figures for the next metrics row."""
        prefetcher, row = self.auto.switch(self.prefetcher, step, paused_s, restart=self._restart,
                                           announce=self._announce)
        if prefetcher is not self.prefetcher:
            self._replaced.append(self.prefetcher)
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
