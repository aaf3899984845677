"""Which documents were in step N? Loss-spike forensics without training or an accelerator.

    python scripts/show_step.py RUN_DIR --step N [--row R] [--tokens] [--json] [--chars 60]

For each row of global step N (or just row R) it prints the row's virtual shard and source, and
for each document in the row: `file:line` (text sources; lines count from 1, as in bad-record
messages) or the record index (converted ArrayRecord sources), its token span [a, b) among the
row's seq_len + 1 tokens, and the first characters of its text; --tokens adds each document's
decoded tokens; --json prints one JSON object instead (per row also the hash that
`train.debug_batches=true` logs, so a replay can be checked against a run).

How. The global batch layout is fixed (data/host.py): virtual shard v fills rows
[v*k, (v+1)*k) of every global batch, k = data.global_batch_size / data.num_shards, whatever
the hosts and workers. Step s consumes the s-th global batch (steps count from 1), and a
checkpoint at step c holds every shard's data position after batch c. So row R of step N is row
(N-1-c)*k + R%k of shard R//k's stream counted from checkpoint c: the script restores only the
shards that feed the requested rows, in this process, from the merged data state of the nearest
checkpoint before N, and replays them (reading only those shards' files).

Where a step's data position comes from, in order:
  1. the run's latest checkpoint c < N (its data item: every host's state, merged per shard);
  2. before the run's first checkpoint: the initial position (step 0) when the run's data
     started from scratch, or the checkpoint it was forked from (`checkpoint.resume_from` in its
     saved config: that step directory, or the latest step of that directory before this run's
     first checkpoint);
  3. otherwise the step is refused, naming the steps that can be shown.
When the checkpoint after N holds another data fingerprint than the one before N, a session
resumed at the one before N on changed data, and the replay takes the later checkpoint's
settings: with checkpoint.allow_data_change that session read the new data from its start (the
replay too); otherwise a mixture changed (data.mixture_change=continue: re-weighted, sources
added or dropped) and every source went on from its saved position (the replay too).
Steps after the last one the run trained (its latest checkpoint or metrics.jsonl row) are
refused. The run's settings come from the checkpoint's saved config; the files are listed again
from its patterns and the data fingerprint (tokenizer, file list, settings, converted
manifests) must match the saved one, else the differing keys are named. A text file edited in
place keeps its name: the fingerprint cannot see that (it holds no sizes of text files).

Cost: one window rebuilt per shard plus the rows up to the step (at most checkpoint.every
batches x k rows per shard); see BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
from etils import epath


class ShowError(ValueError):
    """A mistake in the request or the run directory: printed as one line."""


# ---------------------------------------------------------------- the run directory
@dataclasses.dataclass
class Run:
    run_dir: Path
    config: dict                  # config.yaml (the last start's resolved config)
    ckpt_dir: str
    steps: list[int]              # complete checkpoints
    last_step: int                # the last step known trained


def load_run(run_dir) -> Run:
    import yaml

    from model.runtime.checkpoint import complete_steps

    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise ShowError(f"{run_dir}: no config.yaml, so not a run directory written by train.py")
    config = yaml.safe_load(cfg_path.read_text()) or {}
    ckpt_dir = str((config.get("checkpoint") or {}).get("dir") or "")
    if not ckpt_dir or not epath.Path(ckpt_dir).is_dir():     # checkpoint.dir may be gs://
        ckpt_dir = str(run_dir / "checkpoints")   # the run directory was moved: its own copy
    steps = complete_steps(ckpt_dir)
    logged = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            if line.strip():
                logged.append(int(json.loads(line)["step"]))
    return Run(run_dir, config, ckpt_dir, steps, max(steps + logged, default=0))


@dataclasses.dataclass
class Basis:
    """Where the replay starts: the data position after `step` (None: the initial one)."""
    step: int
    where: str                    # a checkpoint step directory, or "the start of the data"
    host_states: list | None      # every host's saved data state; None = initial
    meta: dict | None             # that checkpoint's meta (config, fingerprint)
    fresh: bool = False           # the data starts at its initial position after `step`


def _restore(directory: str, step: int):
    from model.runtime.checkpoint import ResumePoint, restore_meta_and_data

    return restore_meta_and_data(ResumePoint(directory, step, "tool"))


def _fork_point(run: Run, first_config: dict):
    """(directory, step) of checkpoint.resume_from when the run was forked, else None."""
    from model.runtime.checkpoint import complete_steps, split_step_dir

    src = (first_config.get("checkpoint") or {}).get("resume_from")
    if not src:
        return None
    directory, step = split_step_dir(str(src))
    if step is None:
        own_first = run.steps[0] if run.steps else run.last_step + 1
        earlier = [s for s in complete_steps(directory) if s < own_first]
        if not earlier:
            return None
        step = earlier[-1]
    return directory, step


def find_basis(run: Run, step: int) -> tuple[Basis, dict | None]:
    """(the data position the replay of `step` starts from, the meta of the run's first
    checkpoint at or after `step` or None). Step s consumes batch s; checkpoint c holds the
    position after batch c, so the basis is the nearest c < s."""
    if run.last_step == 0:
        raise ShowError(f"{run.run_dir} holds no trained step yet (no checkpoint in {run.ckpt_dir}, no "
                        "metrics.jsonl row)")
    if step < 1 or step > run.last_step:
        raise ShowError(f"step {step} is outside the steps this run trained: steps 1..{run.last_step} exist "
                        f"(checkpoints {_ranges(run.steps)} in {run.ckpt_dir})")
    later = [c for c in run.steps if c >= step]
    meta_after = _restore(run.ckpt_dir, later[0])[0] if later else None
    before = [c for c in run.steps if c < step]
    if before:
        from model.runtime.rollback import data_override

        meta, states = _restore(run.ckpt_dir, before[-1])
        where = f"{run.ckpt_dir}/{before[-1]}"
        if (override := data_override(run.ckpt_dir, before[-1])) is not None:
            # train.on_divergence=rollback: the steps after this checkpoint trained on the data
            # from where the last rollback to it left off (model/runtime/rollback.py).
            record, states = override
            where += f", past the steps rolled back at step {record['seen_at_step']} ({record['dir']})"
        return Basis(before[-1], where, states, meta), meta_after
    # Before the run's first checkpoint: where did its data start? The saved config of the
    # session that wrote the first checkpoint says (config.yaml is rewritten by every start).
    first_config = (meta_after or {}).get("config") or run.config
    fork = _fork_point(run, first_config)
    src = (first_config.get("checkpoint") or {}).get("resume_from")
    if src and fork is None:
        raise ShowError(f"step {step} is before the first data position known for this run: it was forked "
                        f"from checkpoint.resume_from={src}, which holds no step before its own first "
                        f"checkpoint; steps {_showable(run)} can be shown")
    if fork is not None:
        directory, fstep = fork
        if step <= fstep:
            raise ShowError(f"step {step} is before the first data position known for this run: it was "
                            f"forked from {directory}/{fstep}; steps {fstep + 1}..{run.last_step} can be "
                            f"shown here (earlier steps: ask that run)")
        meta, states = _restore(directory, fstep)
        return Basis(fstep, f"{directory}/{fstep}", states, meta), meta_after
    return Basis(0, "the start of the data", None, None, fresh=True), meta_after


def _showable(run: Run) -> str:
    return f"{run.steps[0] + 1}..{run.last_step}" if run.steps and run.steps[0] < run.last_step else "none"


def _ranges(steps: list[int]) -> str:
    if not steps:
        return "none"
    return ", ".join(map(str, steps)) if len(steps) <= 6 else f"{steps[0]}, {steps[1]}, ..., {steps[-1]}"


# ---------------------------------------------------------------- the run's data, as it is now
def data_setup(config: dict, saved_fingerprint: dict | None):
    """(DataConfig, training files, tokenizer) from a saved config, with the files listed again
    from its patterns and checked against the saved data fingerprint."""
    import data as data_lib
    from model.runtime.checkpoint import fingerprint_diffs

    data_map = dict(config["data"])
    eval_map = data_map.pop("eval", None) or {}
    # Replayed in this process: the batches do not depend on the worker count (nor on "auto").
    data_map["num_workers"] = 0
    cfg = data_lib.DataConfig.from_mapping({**data_map, "tokenizer": config["tokenizer"]["path"]})
    eval_paths, holdout = data_lib.eval_settings(eval_map)
    # Listed afresh (never the saved list: the fingerprint check below compares them), and the
    # same held-out split as train.py: the run trained on what is left.
    listing = data_lib.run_listing(cfg.patterns(), eval_paths, None, log=lambda _line: None)
    cfg, _, files, _ = data_lib.split_eval(cfg, listing, holdout)
    tokenizer = data_lib.load_tokenizer(cfg.tokenizer)
    if saved_fingerprint is not None:
        # sources parked by a changed mixture stay in the saved fingerprint (train.py does the same)
        now = data_lib.carry_parked_sources(saved_fingerprint,
                                            data_lib.fingerprint(cfg, tokenizer=tokenizer, files=files))
        diffs = fingerprint_diffs({"data": saved_fingerprint}, {"data": now})
        if diffs:
            raise ShowError("the run's data changed since it was trained (fingerprint: " + "; ".join(diffs)
                            + "): its steps cannot be replayed from these files")
    data_lib.check_files(cfg, 1, files, tokenizer=tokenizer)
    return cfg, files, tokenizer


# ---------------------------------------------------------------- replaying shards
def replay_rows(spec, enc, shard_states: dict | None, shard: int, skip_rows: int, n_rows: int) -> dict:
    """Rows skip_rows .. skip_rows + n_rows of one virtual shard's stream counted from its
    saved state (None: from the start): {"tok", "seg", "pos": int32 [n, R], "did": int64 [n, R]}."""
    from data.host import initial_stream_state, make_shard_stream

    state = (shard_states or {}).get(str(shard)) or initial_stream_state(spec)
    R = spec.seq_len + 1
    stream = make_shard_stream(spec, shard, enc, state)
    try:
        scratch = {"tok": np.empty((1, R), np.int32), "seg": np.empty((1, R), np.int32),
                   "pos": np.empty((1, R), np.int32), "did": np.empty((1, R), np.int64)}
        for _ in range(skip_rows):
            stream.next_row_into(0, scratch)
        out = {"tok": np.empty((n_rows, R), np.int32), "seg": np.empty((n_rows, R), np.int32),
               "pos": np.empty((n_rows, R), np.int32), "did": np.empty((n_rows, R), np.int64)}
        for b in range(n_rows):
            stream.next_row_into(b, out)
    finally:
        stream.close()
    return out


# ---------------------------------------------------------------- documents
def locate(spec, doc_id: int) -> dict:
    """A (debug) doc id -> where the document lives: source, epoch, and file + line (text) or
    record index (converted records). Ids: data/readers/sources.py, data/streams/records.py, data/streams/mixture.py."""
    from data.streams.mixture import SOURCE_ID_SHIFT

    name, sub = None, spec
    if spec.mixture:
        i = doc_id >> SOURCE_ID_SHIFT
        name, _, sub = spec.mixture[i]
        doc_id &= (1 << SOURCE_ID_SHIFT) - 1
    if sub.kind == "records":
        cum = np.concatenate([[0], np.cumsum(np.asarray(sub.records_docs, np.int64))])
        epoch, index = divmod(doc_id, int(cum[-1]))
        f = int(np.searchsorted(cum, index, side="right")) - 1
        return {"source": name, "epoch": epoch, "record": index, "file": sub.files[f],
                "index_in_file": index - int(cum[f]), "_sub": sub}
    epoch, f = divmod(doc_id >> 24, len(sub.files))
    return {"source": name, "epoch": epoch, "file": sub.files[f], "line": (doc_id & 0xFFFFFF) + 1,
            "_sub": sub}


def document_texts(docs: list[dict], tokenizer, chars: int) -> None:
    """Sets docs[i]["text"] to the first `chars` characters of each document: text documents
    are read from their file (one pass per file, up to the last line wanted), records are read
    by index and their first tokens decoded."""
    from data.readers import formats

    by_file: dict = {}
    for d in docs:
        by_file.setdefault(d["file"], []).append(d)
    for path, ds in by_file.items():
        sub = ds[0]["_sub"]
        if sub.kind == "records":
            from array_record.python.array_record_module import ArrayRecordReader

            reader = ArrayRecordReader(path, "readahead_buffer_size:0")
            try:
                wanted = sorted({d["index_in_file"] for d in ds})
                recs = dict(zip(wanted, reader.read(wanted), strict=True))
            finally:
                reader.close()
            for d in ds:
                ids = np.frombuffer(recs[d["index_in_file"]], sub.records_dtype)[:chars + 16]
                d["text"] = tokenizer.decode(ids.tolist())[:chars + 1]
            continue
        wanted = {d["line"] - 1 for d in ds}
        found = {}
        rec = formats.open_records(path, sub.text_key)
        try:
            i = 0
            while len(found) < len(wanted):
                raw, n = rec.next()
                if n == 0:
                    break
                if i in wanted:
                    text, kind = rec.parse(raw)
                    found[i] = text[:chars + 1] if text is not None else f"<{kind}>"
                i += 1
        finally:
            rec.close()
        for d in ds:
            d["text"] = found.get(d["line"] - 1, "<line not found: the file changed since the run?>")


def row_documents(did_r: np.ndarray) -> list[tuple[int, int, int]]:
    """(doc id, a, b): the row's documents in order, tokens [a, b) of the row; padding left out."""
    cuts = np.flatnonzero(np.diff(did_r)) + 1
    bounds = np.concatenate([[0], cuts, [len(did_r)]]).tolist()
    return [(int(did_r[a]), a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if did_r[a] >= 0]


# ---------------------------------------------------------------- the whole question
def show_step(run_dir, step: int, row: int | None = None, *, tokens: bool = False, chars: int = 60) -> dict:
    """The rows of global step `step` of the run in `run_dir` (or just global row `row`), as a
    JSON-ready dict. Raises ShowError (or ValueError from the data checks) in one line."""
    run = load_run(run_dir)
    basis, meta_after = find_basis(run, step)
    return show_steps(run, basis, meta_after, [step], row, tokens=tokens, chars=chars)[0]


def show_rollback(run_dir, which: str, checkpoint_dir: str | None = None, *, chars: int = 60) -> list[dict]:
    """The steps that rollback `which` ("STEP/N": the N-th rollback to checkpoint STEP, from 0)
    rolled back (model/runtime/rollback.py), replayed from where they started: checkpoint STEP's own
    data position for the first, the one before's position for a later one."""
    from model.runtime.rollback import read_states, rollbacks_of

    run = load_run(run_dir)
    ckpt_dir = checkpoint_dir or run.ckpt_dir
    try:
        target, n = (int(x) for x in which.split("/"))
    except ValueError:
        raise ShowError(f"--rollback {which!r}: STEP/N, e.g. 40/0") from None
    records = rollbacks_of(ckpt_dir, target)
    if not 0 <= n < len(records):
        raise ShowError(f"--rollback {which}: {ckpt_dir}/rollbacks/{target} holds rollbacks 0..{len(records) - 1}")
    meta, states = _restore(ckpt_dir, target)
    where = f"{ckpt_dir}/{target}"
    if n > 0:
        states, where = read_states(records[n - 1]["dir"]), f"{where}, past rollback {n - 1} ({records[n - 1]['dir']})"
    first, last = records[n]["rolled_back_steps"]
    return show_steps(run, Basis(target, where, states, meta), None, list(range(first, last + 1)), None,
                      chars=chars)


def show_steps(run: Run, basis: Basis, meta_after: dict | None, steps: list[int], row: int | None = None, *,
               tokens: bool = False, chars: int = 60) -> list[dict]:
    """show_step for consecutive `steps` replayed from one `basis` (each shard replayed once)."""
    from data.batch_log import row_hash
    from data.host import make_encoder
    from data.pipeline import stream_spec
    from data.state import merge_host_states
    from data.streams.mixture import source_of_row, source_thresholds

    if basis.meta and meta_after and basis.meta["fingerprint"]["data"] != meta_after["fingerprint"]["data"]:
        # A session resumed at the basis checkpoint (the latest one then; a later one would carry
        # the new fingerprint) on changed data, with the later checkpoint's settings. With
        # checkpoint.allow_data_change train.py read the new data from its start; otherwise the
        # change was a mixture's (data.mixture_change=continue) and every source went on from its
        # saved position.
        if ((meta_after.get("config") or {}).get("checkpoint") or {}).get("allow_data_change"):
            basis = Basis(basis.step, f"the start of the data changed at step {basis.step} "
                          "(checkpoint.allow_data_change)", None, meta_after, fresh=True)
        else:
            basis = dataclasses.replace(basis, meta=meta_after, where=f"{basis.where}, the mixture changed "
                                        "there (data.mixture_change)")
    saved = basis.meta or meta_after
    config = (saved or {}).get("config") or run.config
    cfg, files, tokenizer = data_setup(config, saved["fingerprint"]["data"] if saved else None)
    B, V = cfg.global_batch_size, cfg.num_shards
    k = B // V
    if row is not None and not 0 <= row < B:
        raise ShowError(f"--row {row}: a global batch of this run has rows 0..{B - 1}")
    rows = [row] if row is not None else list(range(B))
    spec = stream_spec(cfg, 0, 1, files, tokenizer, debug=True)
    shard_states = merge_host_states(basis.host_states)["shards"] if basis.host_states else None
    if basis.host_states is None and not basis.fresh:
        raise ShowError(f"{basis.where} holds no data state: step {steps[0]} cannot be replayed")
    skip = (steps[0] - 1 - basis.step) * k

    got = {}
    # The tokenizer pool an input process builds (shared by the replayed shards).
    enc = make_encoder(spec)
    try:
        for v in sorted({r // k for r in rows}):
            want = [r % k for r in rows if r // k == v]
            out = replay_rows(spec, enc, shard_states, v, skip, (len(steps) - 1) * k + max(want) + 1)
            for i, step in enumerate(steps):
                for j in want:
                    got[step, v * k + j] = (v, out["tok"][i * k + j], out["did"][i * k + j])
    finally:
        if enc is not None:
            enc.close()

    thresholds = source_thresholds([w for _, w, _ in spec.mixture]) if spec.mixture else None
    results, docs = [], []
    for step in steps:
        result_rows = []
        for r in rows:
            v, tok_r, did_r = got[step, r]
            real = did_r[did_r >= 0]
            source = spec.mixture[source_of_row(thresholds, (step - 1) * B + r)][0] if spec.mixture else None
            row_docs = []
            for doc_id, a, b in row_documents(did_r):
                d = {"doc_id": doc_id, "span": [a, b], **locate(spec, doc_id)}
                if tokens:
                    d["decoded"] = tokenizer.decode(tok_r[a:b].tolist(), skip_special_tokens=False)
                row_docs.append(d)
            docs.extend(row_docs)
            entry = {"row": r, "shard": v, "source": source, "hash": row_hash(tok_r[:-1], tok_r[1:], did_r),
                     "first_doc_id": int(real[0]) if real.size else -1,
                     "last_doc_id": int(real[-1]) if real.size else -1,
                     "padding": int((did_r < 0).sum()), "documents": row_docs}
            if tokens:
                entry["tokens"] = tok_r.tolist()
            result_rows.append(entry)
        results.append({"run_dir": str(run.run_dir), "step": step, "from_step": basis.step, "from": basis.where,
                        "replayed_batches": step - 1 - basis.step, "global_batch_size": B, "num_shards": V,
                        "rows": result_rows})
    document_texts(docs, tokenizer, chars)
    for d in docs:
        del d["_sub"]
        d["more"] = len(d["text"]) > chars     # the text goes on beyond what is shown
        d["text"] = d["text"][:chars]
    return results


def format_text(res: dict) -> str:
    lines = [f"step {res['step']} of {res['run_dir']}: data position from {res['from']} "
             f"(step {res['from_step']}), {res['replayed_batches']} batches replayed"]
    for r in res["rows"]:
        src = r["source"] or "data.paths"
        pad = f"  padding {r['padding']}" if r["padding"] else ""
        lines.append(f"row {r['row']}  shard {r['shard']}  source {src}{pad}")
        for d in r["documents"]:
            where = (f"record {d['record']} ({Path(d['file']).name}#{d['index_in_file']})" if "record" in d
                     else f"{d['file']}:{d['line']}")
            epoch = f"  epoch {d['epoch']}" if d["epoch"] else ""
            text = d["text"]
            shown = json.dumps(text, ensure_ascii=False) + ("..." if d["more"] else "")
            lines.append(f"  {where}  tokens [{d['span'][0]}, {d['span'][1]}){epoch}  {shown}")
            if "decoded" in d:
                lines.append("    | " + d["decoded"].replace("\n", "\n    | "))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="Which documents were in a training step (no training, no accelerator).")
    ap.add_argument("run_dir", help="the run directory (holds config.yaml, checkpoints/, metrics.jsonl)")
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--step", type=int, help="the global step (steps count from 1)")
    which.add_argument("--rollback", metavar="STEP/N",
                       help="the steps rolled back by the N-th rollback to checkpoint STEP (train.on_divergence)")
    ap.add_argument("--checkpoint-dir", default=None, help="with --rollback: the run's checkpoint.dir")
    ap.add_argument("--row", type=int, default=None, help="only this row of the global batch")
    ap.add_argument("--tokens", action="store_true", help="also print each document's decoded tokens")
    ap.add_argument("--json", action="store_true",
                    help="one JSON object (rows with the debug_batches hashes)")
    ap.add_argument("--chars", type=int, default=60, help="characters of each document's text shown")
    args = ap.parse_args(argv)
    from model.runtime.distributed import quiet_cpu_start

    quiet_cpu_start()       # before JAX starts: no libtpu warnings where no TPU can be
    import absl.logging
    absl.logging.set_verbosity(absl.logging.ERROR)     # Orbax's info lines are not our output
    try:
        if args.rollback:
            results = show_rollback(args.run_dir, args.rollback, args.checkpoint_dir, chars=args.chars)
        else:
            results = [show_step(args.run_dir, args.step, args.row, tokens=args.tokens, chars=args.chars)]
    except (ValueError, FileNotFoundError) as e:       # ShowError and the data checks' messages
        print("show_step: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    for res in results:
        print(json.dumps(res, ensure_ascii=False) if args.json else format_text(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
