#!/usr/bin/env python3
"""Train the small BPE tokenizer bundled with the sample corpus.

    python scripts/train_tokenizer.py --paths 'data/sample/*/en_head.json.gz' --vocab-size 4096 \
        --out data/sample/tokenizer.json

Byte-level BPE (every byte is reachable, so no text is ever <unk>) with Llama's special-token
ids: <unk>=0, <s>=1 (BOS), </s>=2 (EOS). A small vocabulary keeps the tiny default model's
embedding and logits cheap on a laptop CPU; real runs point `tokenizer.path` at Llama-2's.
"""
import argparse
import glob
import gzip
import json

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]


def iter_texts(patterns: list[str], text_key: str):
    for path in sorted(p for pattern in patterns for p in glob.glob(pattern)):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)[text_key]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", nargs="+", default=["data/sample/*/en_head.json.gz"])
    ap.add_argument("--text-key", default="raw_content")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--out", default="data/sample/tokenizer.json")
    args = ap.parse_args()

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(iter_texts(args.paths, args.text_key), trainer=trainer)
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    tokenizer.save(args.out)
    print(f"wrote {args.out}: vocab {tokenizer.get_vocab_size()}")


if __name__ == "__main__":
    main()
