"""Readers: files -> documents. The lowest band of data/; imports only itself and data/timing.py.

  objstore   URLs (gs://, s3://, hf://, memory://) through fsspec: sizes, buffered reads, listing
  gzseek     seek points in .json.gz files, so a restore opens a file mid-way without re-reading it
  formats    one record reader per input format (JSON lines, JSON arrays, .zst, Parquet, Arrow, ...)
  sources    a file's documents at a position: text, skip rules, bad-record counts and errors
  quality    RedPajama-v2's quality rules: presets (gopher, c4, rpv1) and rule strings over signals
  companions RPv2's companion files found from a documents path; the selection they make per record
"""
