"""Streams: documents -> one virtual shard's packed rows, and its JSON state. The middle band of
data/; imports data/readers/ and the leaves data/timing.py and data/tokenizer.py, never the top.

  permutation  the file order of an epoch, computed on the fly (a Feistel permutation)
  packing      documents' tokens -> fixed-length rows with segment ids and positions
  shard        one virtual shard's text stream (read, tokenize, pack) and its state
  records      the same from a corpus converted by scripts/prepare_data.py (ArrayRecord, no tokenizer)
  buckets      length buckets: only documents of min..max tokens, judged after tokenization
  mixture      weighted mixtures, row by row inside a virtual shard, given already-built streams
"""
