"""DataConfig and cheap validation (run before anything expensive)."""
from __future__ import annotations

import dataclasses

from data.autoworkers import check_num_workers, check_ram_budget, is_auto
from data.listing import list_paths
from data.readers import companions, formats, quality
from data.streams import buckets
from data.tokenizer import BOS_NAMES, load_tokenizer, special_ids, tokenizer_file, tokenizer_hash

PACKINGS = ("concat", "first_fit")
# data.mixture_change: what a resumed run does when data.sources differ from the checkpoint's.
MIXTURE_CHANGES = ("refuse", "continue")
# data.shape_change: what a resumed run does when data.seq_len / data.global_batch_size (and the
# model's max_seq_len and RoPE fields) differ from the checkpoint's (data/resume.py).
SHAPE_CHANGES = ("refuse", "continue")
HEAD_BATCH = ("race", "first", "off")


@dataclasses.dataclass(frozen=True)
class SourceConfig:
    """One source of a mixture (`data.sources`): its files, its share of the rows, its text key
    (None: data.text_key)."""
    name: str
    paths: tuple[str, ...]
    weight: float
    text_key: str | None = None
    min_tokens: int | None = None   # a length bucket (data/streams/buckets.py): documents of at least /
    max_tokens: int | None = None   # at most this many tokens (None or 0: no bound)
    quality: str | list | None = None   # its own data.quality / data.dedup (None: data.quality's,
    dedup: str | list | None = None     # data.dedup's; "" or []: none for this source)

    @classmethod
    def from_mapping(cls, m, index: int) -> "SourceConfig":
        if not isinstance(m, dict):
            raise ValueError(f"data.sources[{index}] must be a mapping with name, paths, weight "
                             f"(got {m!r})")
        where = f"data.sources[{m.get('name', index)}]"
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(m) - names)
        if unknown:
            raise ValueError(f"{where}: unknown setting(s) {unknown}; known: {sorted(names)}")
        missing = [k for k in ("name", "paths", "weight") if k not in m]
        if missing:
            raise ValueError(f"{where}: missing setting(s) {missing}")
        paths = m["paths"]
        paths = (paths,) if isinstance(paths, str) else tuple(str(x) for x in paths or ())
        try:
            weight = float(m["weight"])
        except (TypeError, ValueError):
            raise ValueError(f"{where}.weight={m['weight']!r}: must be a number > 0") from None
        return cls(name=str(m["name"]), paths=paths, weight=weight, text_key=m.get("text_key"),
                   min_tokens=m.get("min_tokens"), max_tokens=m.get("max_tokens"),
                   quality=m.get("quality"), dedup=m.get("dedup"))


@dataclasses.dataclass(frozen=True)
class DataConfig:
    paths: tuple[str, ...]          # globs, plain paths, @file-lists (data/listing.py) of files in any
                                    # format of data/readers/formats.py, a Hugging Face save_to_disk directory,
                                    # or a directory written by scripts/prepare_data.py; () with sources
    tokenizer: str                  # tokenizer.json path, a directory holding it, or a hub id
    seq_len: int
    global_batch_size: int
    text_key: str = "raw_content"
    num_workers: int | str = 1      # Grain worker processes per host (0 = in-process), or "auto"
                                    # (data/autoworkers.py; train.py resolves it to an int)
    ram_budget_gb: float | None = None  # auto: trainer + workers' RSS cap (None: half the RAM)
    auto_measure_steps: int = 20    # auto: steps after the compile measured before choosing
    strict: bool = False
    num_shards: int = 8             # virtual shards V
    packing: str = "concat"         # "concat" | "first_fit"
    shuffle_window: int = 64        # rows; 0 or 1 disables
    files_per_stream: int = 2       # files interleaved inside one shard stream
    add_bos: bool = False
    seed: int = 0
    prefetch: int = 2               # device batches prefetched ahead
    # Input worker processes run this much nicer (lower CPU priority) than the trainer: on a
    # host whose cores the workers keep busy, the training loop's thread is scheduled first
    # when it wakes for the next batch (data/host.py yield_cores). 0: the trainer's priority.
    worker_nice: int = 10
    # With input workers, the first batch and the one after a restore (data/workers.py): "first"
    # made in this process on every core, then the workers start (the first batch soonest;
    # train.py compiles on it while the workers start); "race" made so while the workers start,
    # the first done used; "off" the workers' own (the batches after the first soonest).
    head_batch: str = "first"
    # A checkpoint carries each host's next batch when it is made already, and a restore hands it
    # out first: nothing tokenized before the first step (data/carried.py).
    carry_next_batch: bool = True
    # A weighted mixture (data/streams/mixture.py) instead of `paths`: SourceConfig each.
    sources: tuple[SourceConfig, ...] = ()
    # On resume, "continue": the sources' shares and list may differ from the checkpoint's,
    # every source continuing from its own saved position (data/state.py mixture_changes);
    # "refuse": any data change is refused.
    mixture_change: str = "refuse"
    # A length bucket for data.paths (data/streams/buckets.py): keep only documents of at least /
    # at most this many tokens (0 or None: no bound); a source of data.sources has its own
    # min_tokens / max_tokens.
    min_doc_tokens: int | None = 0
    max_doc_tokens: int | None = 0
    # On resume, "continue": seq_len and global_batch_size may differ from the checkpoint's, the
    # data continuing from the saved positions re-packed at the new length (data/resume.py);
    # "refuse": such a change is refused.
    shape_change: str = "refuse"
    # RedPajama-v2's quality signals and duplicates (data/readers/companions.py): documents kept
    # only when they meet data.quality (a preset gopher / c4 / rpv1, combined with +, or a list
    # of rules such as "rps_doc_word_count >= 50"; data/readers/quality.py) and are not listed
    # in their duplicates file (dedup: exact); decided before tokenizing, dropped ones counted
    # per rule. companions: the root of quality_signals/ and duplicates/ (None: the documents'
    # own root). dedup: fuzzy (or exact,fuzzy) drops the rows a conversion's fuzzy dedup dropped:
    # fuzzy_lists is that conversion's --out (scripts/prepare_data.py --dedup fuzzy writes its
    # fuzzy/<...>.fuzzy.json lists there), dedup_threshold the --dedup-threshold it ran at.
    quality: str | list | None = None
    dedup: str | list | None = None     # "exact,fuzzy" or [exact, fuzzy]
    companions: str | None = None
    fuzzy_lists: str | None = None
    dedup_threshold: str | float | None = "0.8"

    def __post_init__(self):
        p = self.paths
        if isinstance(p, str):
            p = (p,)
        object.__setattr__(self, "paths", tuple(str(x) for x in p or ()))
        object.__setattr__(self, "sources", tuple(
            s if isinstance(s, SourceConfig) else SourceConfig.from_mapping(s, i)
            for i, s in enumerate(self.sources or ())))
        check_sources(self)

    def patterns(self) -> list[str] | dict[str, list[str]]:
        """What the run lists (data/listing.py run_listing): data.paths, or per source its paths."""
        if self.sources:
            return {s.name: list(s.paths) for s in self.sources}
        return list(self.paths)

    def selection(self, src: SourceConfig | None = None) -> dict:
        """data.quality / data.dedup / data.companions (a source's own when it sets them) as
        StreamSpec fields; ValueError naming a bad rule or dedup."""
        where = f"data.sources[{src.name}]." if src is not None else "data."
        q = src.quality if src is not None and src.quality is not None else self.quality
        d = src.dedup if src is not None and src.dedup is not None else self.dedup
        try:
            rules = quality.parse(q)
        except ValueError as e:
            raise ValueError(str(e).replace("data.", where, 1)) from None
        if d is not None and not isinstance(d, str):   # a list (data.dedup=[exact,fuzzy] on the command line)
            d = ",".join(str(x) for x in d)
        asked = [x for x in ("" if d in (None, "", "none") else str(d).replace(" ", "")).split(",") if x]
        if set(asked) - set(companions.DEDUPS):
            raise ValueError(f"{where}dedup={d!r}: must be exact, fuzzy or exact,fuzzy (or null)")
        dedup = ",".join(x for x in companions.DEDUPS if x in asked)
        if not rules and not dedup:
            return {}
        out = {"quality": rules, "dedup": dedup, "companions": self.companions or ""}
        if "fuzzy" in asked:
            if not self.fuzzy_lists:
                raise ValueError(f"{where}dedup={d!r} reads a conversion's fuzzy dedup lists: run "
                                 "scripts/prepare_data.py --paths ... --dedup fuzzy --out DIR first, then "
                                 "set data.fuzzy_lists=DIR")
            out.update(fuzzy_lists=str(self.fuzzy_lists), dedup_threshold=self.threshold())
        return out

    def threshold(self) -> str:
        """data.dedup_threshold as --dedup-threshold writes it ("0.8"); ValueError for another value."""
        t = self.dedup_threshold
        try:
            s = f"{float(t):.1f}" if t is not None else ""
        except (TypeError, ValueError):
            s = ""
        if s not in companions.THRESHOLDS or abs(float(t) - float(s)) > 1e-9:
            raise ValueError(f"data.dedup_threshold={t!r}: must be one of {', '.join(companions.THRESHOLDS)}")
        return s

    def source_text_key(self, src: SourceConfig) -> str:
        return src.text_key or self.text_key

    def bucket(self) -> dict:
        """data.paths' length bucket as StreamSpec fields (data/streams/shard.py)."""
        lo, hi = buckets.check_bounds(self.min_doc_tokens, self.max_doc_tokens, "data.min_doc_tokens",
                                      "data.max_doc_tokens")
        return _bucket_fields(lo, hi, "data.min_doc_tokens" if lo else "data.max_doc_tokens")

    def source_bucket(self, src: SourceConfig) -> dict:
        """A source's length bucket as StreamSpec fields."""
        where = f"data.sources[{src.name}]"
        lo, hi = buckets.check_bounds(src.min_tokens, src.max_tokens, f"{where}.min_tokens",
                                      f"{where}.max_tokens")
        return _bucket_fields(lo, hi, f"{where}.min_tokens" if lo else f"{where}.max_tokens")

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
        if m.get("sources"):
            m.setdefault("paths", ())
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.name not in m and f.default is dataclasses.MISSING]
        if missing:
            raise ValueError(f"missing data setting(s) {missing}")
        return cls(**m)


def _bucket_fields(lo: int, hi: int, key: str) -> dict:
    return {"min_tokens": lo, "max_tokens": hi, "bucket_key": key if lo or hi else ""}


def check_sources(cfg: DataConfig) -> None:
    """The mixture's shape and the length buckets, checked when the config is read (no file
    system access)."""
    cfg.bucket()
    cfg.selection()
    if not cfg.sources:
        return
    if cfg.min_doc_tokens or cfg.max_doc_tokens:
        raise ValueError("data.min_doc_tokens / data.max_doc_tokens bucket data.paths: with data.sources, "
                         "give each source its own min_tokens / max_tokens")
    if cfg.paths:
        raise ValueError("set data.paths (one source) or data.sources (a mixture), not both: "
                         "with data=... configs, override data.paths=[] to use data.sources")
    seen = set()
    for src in cfg.sources:
        where = f"data.sources[{src.name}]"
        if not src.name or "/" in src.name:
            raise ValueError(f"{where}: a source needs a name without '/' (it names metrics)")
        if src.name in seen:
            raise ValueError(f"data.sources: the name {src.name!r} appears twice; names must be "
                             "unique (they key the saved state and the metrics)")
        seen.add(src.name)
        if not src.weight > 0 or src.weight == float("inf"):
            raise ValueError(f"{where}.weight={src.weight}: must be a finite number > 0")
        if not src.paths:
            raise ValueError(f"{where}.paths is empty: give one or more globs of files ("
                             f"{formats.READ_FORMATS})")
        cfg.source_bucket(src)
        cfg.selection(src)


def check_shards(cfg: DataConfig, process_count: int, n_files: int | None) -> None:
    """Virtual shards fill fixed rows of the global batch (k = global_batch_size / V each) and
    split over hosts in equal contiguous blocks: V divides the batch, P divides V. With fewer
    files than shards, files are split across shards (data/streams/shard.py file_split)."""
    V, B = cfg.num_shards, cfg.global_batch_size
    if V < 1 or B % V:
        raise ValueError(
            f"data.num_shards={V} must divide data.global_batch_size={B} (each virtual shard "
            f"fills the same number of rows of every batch): pick a divisor of {B}")
    if V % process_count:
        raise ValueError(
            f"data.num_shards={V} does not split evenly over {process_count} hosts: pick a "
            f"multiple of {process_count} that divides data.global_batch_size={B}")
    # auto needs one worker per host at least (it chooses within the host's shards)
    workers = 1 if is_auto(cfg.num_workers) else max(cfg.num_workers, 1)
    need = process_count * workers
    if V < need:
        raise ValueError(
            f"data.num_shards={V} is smaller than hosts x workers = "
            f"{process_count} x {workers} = {need}: raise data.num_shards "
            f"to at least {need} or lower data.num_workers")
    if n_files == 0:
        raise ValueError("data.paths matches no file")


def check_bos(cfg: DataConfig, bos: int | None) -> None:
    """data.add_bos needs a BOS token: Llama 2 and 3 trained with one first, Qwen has none."""
    if cfg.add_bos and bos is None:
        raise ValueError(f"data.add_bos=true but tokenizer.path={cfg.tokenizer!r} has no BOS "
                         f"token ({', '.join(BOS_NAMES)}; Qwen's tokenizers have none)")


def check_tokenizer(cfg: DataConfig, tok, model_vocab_size: int) -> None:
    """The loaded tokenizer against the run: its ids fit the model's embedding, it has an EOS (the
    document boundary), and a BOS when data.add_bos."""
    if tok.get_vocab_size() > model_vocab_size:
        raise ValueError(f"model.vocab_size={model_vocab_size} is smaller than the tokenizer's "
                         f"{tok.get_vocab_size()} pieces (tokenizer.path={cfg.tokenizer})")
    check_bos(cfg, special_ids(tok)[1])     # special_ids raises when there is no EOS


def validate_settings(cfg: DataConfig, process_count: int) -> None:
    """The checks that need no file: run before the (possibly long) listing."""
    if not cfg.paths and not cfg.sources:
        raise ValueError("data.paths is empty: give one or more globs of files, or @a-file-listing-"
                         f"them.txt (or a mixture under data.sources); read: {formats.READ_FORMATS}")
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
    check_num_workers(cfg.num_workers)
    check_ram_budget(cfg.ram_budget_gb)
    if isinstance(cfg.auto_measure_steps, bool) or not isinstance(cfg.auto_measure_steps, int) \
            or cfg.auto_measure_steps < 1:
        raise ValueError(f"data.auto_measure_steps={cfg.auto_measure_steps!r}: must be an integer >= 1")
    if cfg.shuffle_window < 0:
        raise ValueError(f"data.shuffle_window={cfg.shuffle_window}: must be >= 0")
    if cfg.files_per_stream < 1:
        raise ValueError(f"data.files_per_stream={cfg.files_per_stream}: must be >= 1")
    if cfg.prefetch < 1:
        raise ValueError(f"data.prefetch={cfg.prefetch}: must be >= 1")
    if not isinstance(cfg.worker_nice, int) or not 0 <= cfg.worker_nice <= 19:
        raise ValueError(f"data.worker_nice={cfg.worker_nice!r}: must be an integer from 0 to 19")
    if cfg.head_batch not in HEAD_BATCH:
        raise ValueError(f"data.head_batch={cfg.head_batch!r}: must be one of {HEAD_BATCH}")
    if cfg.mixture_change not in MIXTURE_CHANGES:
        raise ValueError(f"data.mixture_change={cfg.mixture_change!r}: must be one of {MIXTURE_CHANGES}")
    if cfg.shape_change not in SHAPE_CHANGES:
        raise ValueError(f"data.shape_change={cfg.shape_change!r}: must be one of {SHAPE_CHANGES}")
    check_shards(cfg, process_count, None)


def validate(cfg: DataConfig, process_count: int, local_device_count: int) -> None:
    """validate_settings, then the listing of the data against the shard count. train.py
    runs the two halves apart, around its one listing of the run."""
    del local_device_count  # batch-axis divisibility is checked by train.py
    validate_settings(cfg, process_count)
    check_files(cfg, process_count, list_files(cfg))


def check_fuzzy_lists(cfg: DataConfig) -> None:
    """data.dedup with fuzzy: data.fuzzy_lists is a conversion's --out that ran --dedup fuzzy at
    data.dedup_threshold (its job.json, one read); ValueError in one line naming both otherwise."""
    if not any("fuzzy" in cfg.selection(s).get("dedup", "") for s in (None, *cfg.sources)):
        return
    import json
    root, want = str(cfg.fuzzy_lists).rstrip("/"), cfg.threshold()
    try:
        src = formats.open_raw(f"{root}/job.json")
        try:
            job = json.loads(src.read())
        finally:
            src.close()
    except FileNotFoundError:
        job = None
    sel = (job or {}).get("selection") or {}
    if "fuzzy" not in sel.get("dedup", ""):
        raise ValueError(f"data.fuzzy_lists={cfg.fuzzy_lists} holds no conversion with --dedup fuzzy "
                         f"({root}/job.json): run scripts/prepare_data.py --paths ... --dedup fuzzy --out "
                         f"{cfg.fuzzy_lists} first")
    if sel.get("dedup_threshold") != want:
        raise ValueError(f"data.dedup_threshold={want} but data.fuzzy_lists={cfg.fuzzy_lists} was converted "
                         f"with --dedup-threshold {sel.get('dedup_threshold')}: set data.dedup_threshold="
                         f"{sel.get('dedup_threshold')} or convert again")


def check_files(cfg: DataConfig, process_count: int, files, tokenizer=None) -> None:
    """The checks that need the listing (list_files' result): every source has files, and a
    converted directory is what its manifest describes, written with the run's tokenizer (one
    stat per file and the tokenizer's hash, no read), with at least one document per shard."""
    from data.streams import records

    check_shards(cfg, process_count, None)
    check_fuzzy_lists(cfg)
    named = ([(f"data.sources[{s.name}]", files[s.name]) for s in cfg.sources]
             if isinstance(files, dict) else [("data.paths", files)])
    for where, fs in named:
        if not fs:
            raise ValueError(f"{where} matches no file")
        info = records.describe(fs)
        if info is None:   # text: a file that is no format read here fails now, in one line
            formats.check_readable(fs, where)
            continue
        src = next((s for s in cfg.sources if where.endswith(f"[{s.name}]")), None)
        if cfg.selection(src):
            raise ValueError(f"{where} is a converted directory: its documents were selected when "
                             "converted (scripts/prepare_data.py --quality / --dedup); set "
                             "data.quality / data.dedup for text files only")
        tok = tokenizer if tokenizer is not None else load_tokenizer(cfg.tokenizer)
        info.check(tokenizer_hash(tok), cfg.tokenizer, tok.get_vocab_size())
        if cfg.num_shards > info.documents:
            raise ValueError(f"data.num_shards={cfg.num_shards} is larger than the "
                             f"{info.documents} documents of {info.root}: lower data.num_shards")


def list_files(cfg: DataConfig) -> list[str] | dict[str, list[str]]:
    """The files of `cfg.paths`; for a mixture, {source name: its files} (ValueError naming
    an entry that matches no file). A converted directory stands for the ArrayRecord files its
    manifest lists (no directory walk)."""
    if cfg.sources:
        return {s.name: list_paths(s.paths, f"data.sources[{s.name}].paths").files
                for s in cfg.sources}
    return list_paths(cfg.paths).files


