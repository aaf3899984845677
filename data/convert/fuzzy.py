"""--dedup fuzzy: RedPajama-v2's minhash bands (data/readers/companions.py's `minhash` files). A
document is dropped when another document with a smaller id_int has the same band hash at the
same position of its signature_sim<threshold> (the bands alone, as RPv2's own dedup, no Jaccard
check). `fuzzy_dropped` does it in memory (the in-process converter); data/convert/beam.py does it
as a GroupByKey over (position, hash) buckets with the same `file_bands` and `bucket_dropped`.
"""
from __future__ import annotations

from data.readers import companions, formats
from data.readers.companions import FUZZY  # noqa: F401  (the name a fuzzy duplicate is counted under)


def file_bands(path: str, threshold: str, root: str | None = None):
    """(row, id_int, bands) of each document of the documents file `path`, from its minhash file;
    FileNotFoundError (naming the minhash file) when it is missing; ValueError naming file and
    row for an id that names no row."""
    col = f"signature_sim{threshold}"
    mp = companions.companion_path(path, "minhash", root)
    try:
        t = formats.read_parquet_columns(mp, ["id", "id_int", col])
    except FileNotFoundError:
        raise FileNotFoundError(mp) from None
    out = []
    for k, (i, n, bs) in enumerate(zip(t.column("id").to_pylist(), t.column("id_int").to_pylist(),
                                       t.column(col).to_pylist(), strict=True)):
        row = companions.row_of(str(i))
        if row is None or n is None:
            raise ValueError(f"{mp}: row {k} (id {i!r}, id_int {n!r}) names no documents row")
        out.append((row, n, tuple(bs or ())))
    return out


def bucket_dropped(members) -> list:
    """Of the (id_int, what) members of one (position, hash) bucket, the `what` of each one that a
    member with a smaller id_int precedes (equal id_ints drop nothing: RPv2's ids are unique)."""
    members = list(members)
    least = min(n for n, _ in members)
    return [w for n, w in members if n > least]


def fuzzy_dropped(files: list[str], threshold: str, root: str | None = None) -> dict:
    """{documents file: its rows to drop}, in memory (about 200 bytes per document and band
    position held). A file whose minhash file is missing is left out, and that minhash file named
    in a list under the key None."""
    buckets: dict[tuple[int, bytes], list] = {}
    out: dict = {}
    for path in files:
        try:
            rows = file_bands(path, threshold, root)
        except FileNotFoundError as e:
            out.setdefault(None, []).append(str(e))
            continue
        out[path] = set()
        for row, n, bands in rows:
            for j, h in enumerate(bands):
                buckets.setdefault((j, h), []).append((n, (path, row)))
    for members in buckets.values():
        if len(members) > 1:
            for path, row in bucket_dropped(members):
                out[path].add(row)
    return out
