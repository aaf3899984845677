"""The conversion (scripts/prepare_data.py): input files -> ArrayRecord parts of token ids.

  parts   one input file -> one part and its done/ marker; the in-process Converter
  fuzzy   --dedup fuzzy over RPv2's minhash bands: in memory, and the bucket rule Beam shares
  beam    the conversion as an Apache Beam pipeline (the [beam] extra; imported only for --runner)
"""
