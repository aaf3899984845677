"""DataConfig and cheap validation (run before anything expensive)."""
from __future__ import annotations

import dataclasses
import os

from data import records
from data.sources import expand_paths, missing_paths
from data.tokenizer import load_tokenizer, tokenizer_file, tokenizer_hash

PACKINGS = ("concat", "first_fit")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    paths: tuple[str, ...]          # globs; '~' expanded; relative paths as given; or a
                                    # directory written by scripts/prepare_data.py
    tokenizer: str                  # tokenizer.json path, a directory holding it, or a hub id
    seq_len: int
    global_batch_size: int
    text_key: str = "raw_content"
    num_workers: int = 1            # Grain worker processes per host (0 = in-process)
    strict: bool = False
    num_shards: int = 8             # virtual shards V
    packing: str = "concat"         # "concat" | "first_fit"
    shuffle_window: int = 64        # rows; 0 or 1 disables
    files_per_stream: int = 2       # files interleaved inside one shard stream
    add_bos: bool = False
    seed: int = 0
    prefetch: int = 2               # device batches prefetched ahead

    def __post_init__(self):
        p = self.paths
        if isinstance(p, str):
            p = (p,)
        object.__setattr__(self, "paths", tuple(str(x) for x in p))

    @classmethod
    def from_mapping(cls, m) -> "DataConfig":
        try:  # omegaconf DictConfig -> plain dict
            from omegaconf import DictConfig, OmegaConf
            if isinstance(m, DictConfig):
                m = OmegaConf.to_container(m, resolve=True)
        except ImportError:  # pragma: no cover
            pass
        m = dict(m)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(m) - names)
        if unknown:
            raise ValueError(f"unknown data setting(s) {unknown}; known: {sorted(names)}")
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.name not in m and f.default is dataclasses.MISSING]
        if missing:
            raise ValueError(f"missing data setting(s) {missing}")
        if isinstance(m["paths"], str):
            m["paths"] = (m["paths"],)
        else:
            m["paths"] = tuple(m["paths"])
        return cls(**m)


def check_shards(cfg: DataConfig, process_count: int, n_files: int | None) -> None:
    """Virtual shards fill fixed rows of the global batch (k = global_batch_size / V each) and
    split over hosts in equal contiguous blocks: V divides the batch, P divides V."""
    V, B = cfg.num_shards, cfg.global_batch_size
    if V < 1 or B % V:
        raise ValueError(
            f"data.num_shards={V} must divide data.global_batch_size={B} (each virtual shard "
            f"fills the same number of rows of every batch): pick a divisor of {B}")
    if V % process_count:
        raise ValueError(
            f"data.num_shards={V} does not split evenly over {process_count} hosts: pick a "
            f"multiple of {process_count} that divides data.global_batch_size={B}")
    need = process_count * max(cfg.num_workers, 1)
    if V < need:
        raise ValueError(
            f"data.num_shards={V} is smaller than hosts x workers = "
            f"{process_count} x {max(cfg.num_workers, 1)} = {need}: raise data.num_shards "
            f"to at least {need} or lower data.num_workers")
    if n_files is not None and V > n_files:
        raise ValueError(
            f"data.num_shards={V} is larger than the number of files "
            f"({n_files}) matched by data.paths: lower data.num_shards to at most {n_files}")


def validate(cfg: DataConfig, process_count: int, local_device_count: int) -> None:
    del local_device_count  # batch-axis divisibility is checked by train.py
    if not cfg.paths:
        raise ValueError("data.paths is empty: give one or more globs of .json.gz/.jsonl/"
                         ".jsonl.zst files")
    globs = [p for p in cfg.paths if not os.path.isdir(os.path.expanduser(str(p)))]
    for p in cfg.paths:
        if p not in globs and not records.is_converted_dir(p):
            raise ValueError(f"data.paths: {p!r} is a directory without {records.MANIFEST}: "
                             "give globs of .json.gz/.jsonl/.jsonl.zst files or a directory "
                             "written by scripts/prepare_data.py")
    bad = missing_paths(globs)
    if bad:
        raise ValueError(f"data.paths: {bad[0]!r} matches no file")
    try:
        tokenizer_file(cfg.tokenizer)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    if cfg.packing not in PACKINGS:
        raise ValueError(f"data.packing={cfg.packing!r}: must be one of {PACKINGS}")
    if cfg.seq_len < 1:
        raise ValueError(f"data.seq_len={cfg.seq_len}: must be >= 1")
    if cfg.global_batch_size < 1 or cfg.global_batch_size % process_count:
        raise ValueError(f"data.global_batch_size={cfg.global_batch_size} is not divisible by "
                         f"the process count {process_count}")
    if cfg.num_workers < 0:
        raise ValueError(f"data.num_workers={cfg.num_workers}: must be >= 0")
    if cfg.shuffle_window < 0:
        raise ValueError(f"data.shuffle_window={cfg.shuffle_window}: must be >= 0")
    if cfg.files_per_stream < 1:
        raise ValueError(f"data.files_per_stream={cfg.files_per_stream}: must be >= 1")
    if cfg.prefetch < 1:
        raise ValueError(f"data.prefetch={cfg.prefetch}: must be >= 1")
    files = list_files(cfg)
    info = records.describe(files)
    if info is None:
        check_shards(cfg, process_count, len(files))
        return
    # A converted directory: its files are those its manifest describes, and it was written
    # with this run's tokenizer (one stat per file and a tokenizer load, no read).
    info.check(tokenizer_hash(load_tokenizer(cfg.tokenizer)), cfg.tokenizer)
    check_shards(cfg, process_count, None)
    if cfg.num_shards > info.documents:
        raise ValueError(f"data.num_shards={cfg.num_shards} is larger than the "
                         f"{info.documents} documents of {info.root}: lower data.num_shards")


def list_files(cfg: DataConfig) -> list[str]:
    """The source's files: the globs' matches, and for a converted directory the ArrayRecord
    files its manifest lists (no directory walk)."""
    files = set()
    globs = []
    for p in cfg.paths:
        if records.is_converted_dir(p):
            files.update(records.part_files(p))
        else:
            globs.append(p)
    files.update(expand_paths(globs))
    return sorted(files)
