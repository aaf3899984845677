"""The conversion as an Apache Beam pipeline (scripts/prepare_data.py --runner DirectRunner |
DataflowRunner | FlinkRunner | SparkRunner; the [beam] extra; docs/tokenize-at-scale.md).

  files to do --------------------------------------------------------\\
  every file -> its minhash bands -> GroupByKey((position, hash)) -> rows dropped --CoGroupByKey(file)
        -> ConvertPart (Converter.run on that one file: the in-process converter's own code)
        -> Count -> manifest.json (every part's done marker)

One part per input file, byte-identical to the in-process converter's: a part's bytes depend on
its file, the tokenizer and the selection only (the same `Converter.run`), never on which worker
or attempt wrote it. A worker writes a part under its own temporary name and renames it when
complete, then its done/ marker, so Beam's retries and a restart of the whole job are safe: the
launcher converts only the parts whose done marker is missing, clearing what killed attempts left.

--dedup fuzzy is a GroupByKey over (band position, band hash) buckets: in each bucket every
document but the one with the smallest id_int is dropped (data/convert/fuzzy.py's rule, shared
with the in-memory path), and each file's dropped rows meet the file in a CoGroupByKey.
"""
from __future__ import annotations

import os
import time
import uuid

import apache_beam as beam
from apache_beam.options.pipeline_options import (
    GoogleCloudOptions,
    PipelineOptions,
    SetupOptions,
    WorkerOptions,
)

from data.convert.fuzzy import bucket_dropped, file_bands
from data.convert.parts import Converter
from data.readers import objstore


def _project_file() -> str | None:
    """This project's pyproject.toml when it runs from a checkout (an editable install), else None."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "pyproject.toml")
    return path if os.path.isfile(path) else None


def pipeline_options(runner: str, beam_args: list[str], args=None) -> PipelineOptions:
    """Beam's options: `--runner` plus everything after the script's own flags. For Dataflow the
    workers must get this project: unless --setup_file, --requirements_file, --extra_package(s) or
    --sdk_container_image says how, --setup_file is this checkout's pyproject.toml (Beam builds an
    sdist from it and each worker pip-installs it). ValueError names what Dataflow lacks."""
    opts = PipelineOptions(["--runner", runner, *beam_args])
    if runner != "DataflowRunner":
        return opts
    gcp = opts.view_as(GoogleCloudOptions)
    missing = [f"--{k}" for k in ("project", "region", "temp_location") if not getattr(gcp, k)]
    if missing:
        raise ValueError(f"--runner DataflowRunner needs {', '.join(missing)} (Beam's options, after the "
                         "script's own; docs/tokenize-at-scale.md)")
    if args is not None:
        local = [f"--{k}={v}" for k, v in (("paths", " ".join(args.paths)), ("out", args.out))
                 if not all(objstore.is_url(p) or p.startswith("@") for p in ([v] if k == "out" else args.paths))]
        if local:
            raise ValueError(f"--runner DataflowRunner reads and writes from its workers: {local[0]} must be "
                             "a URL (gs://BUCKET/...)")
    setup = opts.view_as(SetupOptions)
    worker = opts.view_as(WorkerOptions)
    given = (setup.setup_file or setup.requirements_file or setup.extra_packages
             or getattr(worker, "sdk_container_image", None))
    if not given:
        project = _project_file()
        if project is None:
            raise ValueError("--runner DataflowRunner: say what the workers install: --setup_file "
                             "PATH/TO/pyproject.toml of this project, --extra_package a wheel of it, or "
                             "--sdk_container_image an image with it (docs/tokenize-at-scale.md)")
        setup.setup_file = project
    return opts


class _Bands(beam.DoFn):
    """A documents file -> ((position, hash), (id_int, (file, row))) per band; the file on the
    `missing` output when its minhash file is not there."""

    def __init__(self, threshold: str, root: str | None):
        self.threshold, self.root = threshold, root

    def process(self, path):
        try:
            rows = file_bands(path, self.threshold, self.root)
        except FileNotFoundError:
            yield beam.pvalue.TaggedOutput("missing", (path, True))
            return
        for row, n, bands in rows:
            for j, h in enumerate(bands):
                yield (j, h), (n, (path, row))


def _dropped(bucket):
    _, members = bucket
    return bucket_dropped(members)


class _NoBar:
    """What Converter.run reports progress to, on a worker (no terminal)."""
    n = 0

    def update(self, _n) -> None:
        pass

    def set_postfix_str(self, *_a, **_k) -> None:
        pass


class ConvertPart(beam.DoFn):
    """(file, {"part": [i], "drop": [rows], "missing": [...]}) -> part i written and committed, then
    its done marker; yields i. One Converter per worker (its tokenizer pool built once)."""

    def __init__(self, args, files: list[str], tok_json: str, sizes: dict, fuzzy: bool):
        self.args, self.files, self.tok_json, self.sizes, self.fuzzy = args, files, tok_json, sizes, fuzzy
        self.conv = None

    def setup(self):
        from tokenizers import Tokenizer
        # A name of its own per worker instance: two attempts at one part (a retry, a straggler's
        # backup) never write the same temporary file; the rename is the commit.
        owner = f"beam-{uuid.uuid4().hex[:12]}"
        self.conv = Converter(self.args, self.files, Tokenizer.from_str(self.tok_json), self.sizes, owner=owner)
        self.conv.store.open()

    def process(self, element):
        path, got = element
        for i in got["part"]:
            if self.fuzzy:   # a file without a minhash file is left out: Converter names it
                missing = list(got.get("missing", ()))   # grouped values may be lazy iterables
                self.conv.fuzzy = {} if missing else {path: set(got.get("drop", ()))}
            self.conv.run([i], _NoBar())
            yield i

    def teardown(self):
        if self.conv is not None:
            self.conv.enc.close()
            self.conv.store.close()


class WriteManifest(beam.DoFn):
    """After every part: manifest.json from all done markers (those of earlier runs included)."""

    def __init__(self, args, files: list[str], tok_json: str):
        self.args, self.files, self.tok_json = args, files, tok_json

    def process(self, _count):
        import json

        from tokenizers import Tokenizer

        from data.streams import records
        conv = Converter(self.args, self.files, Tokenizer.from_str(self.tok_json),
                         owner=f"beam-{uuid.uuid4().hex[:12]}")
        try:
            conv.store.open()
            m = conv.manifest()
            if m is None:
                raise RuntimeError(f"prepare_data: some done marker under {self.args.out}/done is missing "
                                   "after every part ran")
            conv.store.write_text(records.MANIFEST, json.dumps(m, indent=1))
        finally:
            conv.enc.close()
            conv.store.close()
        yield m["documents"]


def build(p: beam.Pipeline, args, files: list[str], todo: list[int], tok_json: str, sizes: dict) -> None:
    """The conversion's transforms on pipeline `p`: the parts `todo` (indices into `files`)."""
    fuzzy = "fuzzy" in (args.dedup or "")
    parts = p | "FilesToDo" >> beam.Create([(files[i], i) for i in todo])
    if fuzzy:
        # Every file's bands, not only the ones to do: a kept document of a finished part still
        # drops its later copies elsewhere.
        bands = (p | "EveryFile" >> beam.Create(files)
                 | "Bands" >> beam.ParDo(_Bands(args.dedup_threshold, args.companions)).with_outputs(
                     "missing", main="bands"))
        drops = (bands.bands | "Buckets" >> beam.GroupByKey()
                 | "Dropped" >> beam.FlatMap(_dropped))
        work = ({"part": parts, "drop": drops, "missing": bands.missing}
                | "ByFile" >> beam.CoGroupByKey()
                | "OnlyToDo" >> beam.Filter(lambda kv: any(True for _ in kv[1]["part"])))
    else:
        # A shuffle keyed by file spreads the parts over the workers (a Create is one bundle).
        work = (parts | "ByFile" >> beam.GroupByKey()
                | "AsWork" >> beam.MapTuple(lambda path, i: (path, {"part": list(i)})))
    done = work | "ConvertPart" >> beam.ParDo(ConvertPart(args, files, tok_json, sizes, fuzzy))
    (done | "EveryPart" >> beam.combiners.Count.Globally()
     | "Manifest" >> beam.ParDo(WriteManifest(args, files, tok_json)))


def run(args, files: list[str], todo: list[int], tok, sizes: dict, beam_args: list[str]) -> float:
    """Run the pipeline to its end (the manifest written); its wall seconds."""
    opts = pipeline_options(args.runner, beam_args, args)
    t0 = time.perf_counter()
    with beam.Pipeline(options=opts) as p:
        build(p, args, files, todo, tok.to_str(), sizes)
    return time.perf_counter() - t0

