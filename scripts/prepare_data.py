"""Tokenize a corpus once into ArrayRecord files of documents, for `data.paths=DIR`.

  python scripts/prepare_data.py --paths '/mnt/rp/documents/*/*/en_head.json.gz' \
      --tokenizer data/sample/tokenizer.json --out /mnt/rp_tok

Reads what the streaming path reads (JSON lines, JSON arrays, Parquet, Arrow: data/readers/formats.py;
the text under --text-key) with its bad-record policy: a bad record is skipped, counted by kind and named
(file:line) in the summary; with --strict the first one stops the run, naming file:line.
Documents are tokenized on all cores (a thread per core, the tokenizer releases the GIL) and
stored as bare token ids (uint16 for vocabularies of up to 65,536 ids, else uint32, as for Llama 3's
and Qwen's; the manifest's "dtype" says which; no EOS/BOS: the training source adds them as the
text path does), so seq_len and packing stay free.

Output, one ArrayRecord file per input file (input i of the sorted list -> part-NNNNNN):
  DIR/job.json                      inputs, tokenizer hash, text key, dtype (checked on restart)
  DIR/part-000000.array_record      documents of input 0, in file order
  DIR/done/part-000000.json         written once part-000000 is complete (its counts)
  DIR/manifest.json                 written when every part is done: what training reads
  DIR/fuzzy/<rel>.fuzzy.json        --dedup fuzzy: the rows it dropped from that input (data.fuzzy_lists=DIR)
A part is written under a temporary name and renamed when complete, so a conversion killed
at any moment (SIGKILL included) continues when started again with the same arguments and
ends byte-identical to an uninterrupted one; the same inputs always give the same bytes.

--paths and --out may be URLs (gs://, s3://, hf://, any fsspec scheme; data/readers/objstore.py): input
sizes come from the pattern's listing, and a URL --out gets each part written to a local
temporary directory (--tmp) and uploaded when complete (an object appears whole or not at all),
then its done/ marker, the manifest last; a restart lists --out once to find the finished parts.

With --quality / --dedup (RedPajama-v2's quality signals and duplicates, as data.quality and
data.dedup take them: docs/data.md "RedPajama-v2's quality signals and duplicates") a part holds
only the documents kept, judged before tokenizing by the stream's own code
(data/readers/companions.py); dropped ones are counted per rule in done/ and the manifest, bad
companions are bad records. --dedup fuzzy runs in memory in this process: every input's minhash
file is read first (about 200 bytes per document and band position held), then a document is
dropped when another with a smaller id_int has the same band hash at the same position of
signature_sim<--dedup-threshold>. Its result, the rows dropped, is written beside the parts as
one JSON list per input file, DIR/fuzzy/<snap>/<shard>/<lang>_<part>.fuzzy.json (before the part's
done/ marker; the same bytes from every runner), which the stream reads with data.dedup=fuzzy
data.fuzzy_lists=DIR (docs/data.md).

--runner DirectRunner | DataflowRunner | FlinkRunner | SparkRunner runs the same conversion as an
Apache Beam pipeline (the [beam] extra; data/convert/beam.py; docs/tokenize-at-scale.md): Beam's own
options follow the script's (optionally after `--`), one part per input file byte-identical to
this process's, fuzzy dedup as a GroupByKey over band buckets. This process then only lists the
inputs, checks job.json and clears what killed attempts left; the workers convert.

On a pod every host converts its own share of the input files (input i goes to host
i % process_count) into the same DIR on a shared bucket mount (or the same URL); the last host
to finish writes the manifest (run it on all workers, each with its --process-index; see docs/data.md "Tokenize once").
"""
from __future__ import annotations

import argparse
import json
import sys

from data.convert.fuzzy import fuzzy_dropped
from data.convert.parts import Converter, part_name, selection_of
from data.listing import list_paths
from data.readers import objstore
from data.streams import records
from data.tokenizer import load_tokenizer

# Beam's runners --runner takes (data/convert/beam.py, which imports Beam, is loaded only for them).
RUNNERS = ("DirectRunner", "DataflowRunner", "FlinkRunner", "SparkRunner")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", nargs="+", required=True,
                    help="input files as data.paths takes them: globs, paths, @lists, URLs (gs://...)")
    ap.add_argument("--tokenizer", required=True, help="tokenizer.json, a directory or a hub id")
    ap.add_argument("--out", required=True, help="output directory (data.paths=DIR) or URL (gs://BUCKET/DIR)")
    ap.add_argument("--tmp", default=None, help="local directory for the part in flight when --out is a "
                    "URL (default: the system's temporary directory)")
    ap.add_argument("--text-key", default="raw_content")
    ap.add_argument("--strict", action="store_true", help="stop at the first bad record")
    ap.add_argument("--process-index", type=int, default=0, help="this host's index (pods)")
    ap.add_argument("--process-count", type=int, default=1, help="hosts converting (pods)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--quality", nargs="+", default=None,
                    help="RedPajama-v2 quality rules, as data.quality: presets (gopher, c4, rpv1; "
                    "joined by +) and/or rules such as 'rps_doc_word_count >= 50'")
    ap.add_argument("--dedup", default=None, help="exact (the duplicates files), fuzzy (minhash "
                    "bands, in memory) or exact,fuzzy")
    ap.add_argument("--dedup-threshold", default="0.8", choices=("0.7", "0.8", "0.9", "1.0"),
                    help="--dedup fuzzy: the signature_sim<T> column whose bands are compared")
    ap.add_argument("--companions", default=None,
                    help="the root of quality_signals/, duplicates/, minhash/ (default: the documents' own)")
    ap.add_argument("--runner", default="local", choices=("local", *RUNNERS),
                    help="local: this process (and --process-count hosts); a Beam runner: the conversion as an "
                    "Apache Beam pipeline (the [beam] extra), Beam's own options after the script's "
                    "(docs/tokenize-at-scale.md)")
    args, beam_args = ap.parse_known_args(argv)
    if beam_args[:1] == ["--"]:   # `-- --project=...`: an explicit start of Beam's options
        beam_args = beam_args[1:]
    if beam_args and args.runner == "local":
        ap.error(f"unrecognized arguments: {' '.join(beam_args)} (Beam's options go with a Beam --runner)")
    if args.runner != "local" and args.process_count != 1:
        ap.error("--process-count is for --runner local; a Beam runner spreads the files over its own workers")
    args.beam_args = beam_args
    try:
        selection_of(args)
    except ValueError as e:
        ap.error(str(e))
    if not 0 <= args.process_index < args.process_count:
        ap.error(f"--process-index={args.process_index} must be in [0, --process-count="
                 f"{args.process_count})")
    return args


def main(argv=None) -> int:
    from tqdm import tqdm
    args = parse_args(argv)
    try:   # globs, plain paths or @file-lists, as data.paths takes them
        listing = list_paths(args.paths, "--paths")
        files = listing.files
    except ValueError as e:
        raise SystemExit(f"prepare_data: {e}") from None
    try:
        tok = load_tokenizer(args.tokenizer)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"prepare_data: {e}") from None
    if args.runner != "local":
        return _run_beam(args, files, tok, listing.sizes)
    conv = Converter(args, files, tok, listing.sizes)
    try:
        conv.start()
        mine = list(range(args.process_index, len(files), args.process_count))
        todo = conv.pending(mine)
        if todo and "fuzzy" in conv.selection.get("dedup", ""):
            try:
                conv.fuzzy = fuzzy_dropped(files, args.dedup_threshold, args.companions)
            except ValueError as e:   # a minhash row naming no documents row
                raise SystemExit(f"prepare_data: {e}") from None
            conv.fuzzy.pop(None, None)
        total = sum(conv.size(i) for i in todo)
        with tqdm(total=total, unit="B", unit_scale=True, disable=args.no_progress,
                  desc=f"host {args.process_index}: {len(todo)} of {len(mine)} files") as bar:
            stats = conv.run(todo, bar)
        conv.enc.close()
        m = conv.manifest()
        if m is not None:
            conv.store.write_text(records.MANIFEST, json.dumps(m, indent=1))
    finally:
        conv.store.close()   # the local staging directory of a URL --out
    _summary(args, files, mine, todo, stats, m)
    return 0


def _run_beam(args, files, tok, sizes) -> int:
    """--runner DirectRunner|DataflowRunner|...: job.json checked or written and killed attempts'
    leftovers cleared here, then the pipeline converts the parts not done and writes the manifest."""
    try:
        from data.convert import beam as beam_conv
    except ImportError as e:
        raise SystemExit(f"prepare_data: --runner {args.runner} needs Apache Beam: pip install -e '.[beam]' "
                         f"({e})") from None
    conv = Converter(args, files, tok, sizes)
    conv.enc.close()   # the workers tokenize
    try:
        conv.start()
        mine = list(range(len(files)))
        todo = conv.pending(mine)
    finally:
        conv.store.close()
    try:
        seconds = beam_conv.run(args, files, todo, tok, sizes, args.beam_args)
    except ValueError as e:
        raise SystemExit(f"prepare_data: {e}") from None
    m = json.loads(open(conv.store.join(records.MANIFEST)).read()) if not objstore.is_url(args.out) \
        else json.loads(conv.store.fs.cat_file(conv.store.join(records.MANIFEST)))
    done = {f["file"]: f for f in m["files"]}
    made = [done[part_name(i)] for i in todo]
    stats = {"parts": len(todo), "docs": sum(f["documents"] for f in made),
             "tokens": sum(f["tokens"] for f in made), "seconds": seconds}
    _summary(args, files, mine, todo, stats, m)
    return 0


def _summary(args, files, mine, todo, stats, m) -> None:
    s = max(stats["seconds"], 1e-9)
    who = f"Host {args.process_index} of {args.process_count}" if args.runner == "local" else args.runner
    text = (f"{who} converted {stats['parts']} of its "
            f"{len(mine)} files ({len(mine) - len(todo)} were already done) in {s:.1f} s: "
            f"{stats['docs']:,} documents, {stats['tokens']:,} tokens "
            f"({stats['docs'] / s:,.0f} docs/s, {stats['tokens'] / s:,.0f} tokens/s) into "
            f"{args.out}. ")
    if m is None:
        text += ("Other hosts' parts are not all done yet: the last host to finish writes "
                 f"{records.MANIFEST}.")
    else:
        bytes_ = sum(p["bytes"] for p in m["files"])
        bad = sum(m["bad_records"].values())
        text += (f"All {len(files)} files are done: {m['documents']:,} documents, "
                 f"{m['tokens']:,} {m['dtype']} tokens, {bytes_ / max(m['tokens'], 1):.2f} bytes "
                 f"per token on disk; {bad} bad records skipped"
                 + (f" ({', '.join(f'{k}: {v}' for k, v in m['bad_records'].items())}; e.g. "
                    f"{m['bad_examples'][0]})" if bad else "")
                 + (f". Train on it with data.paths={args.out}" if not objstore.is_url(args.out)
                    else f". Training reads {records.from_local_storage(args.out)}"))
    print(text, flush=True)


if __name__ == "__main__":
    sys.exit(main())
