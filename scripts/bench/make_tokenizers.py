"""Stand-ins for Llama 3's and Qwen2's tokenizers, built here (no hub): byte-level BPE with the
family's pre-tokenizer split, normalizer, special tokens at the family's ids, post-processor and
decoder, and a vocabulary of the family's size trained on local text.

  python scripts/bench/make_tokenizers.py --family llama3 --out /tmp/llama3_style_tokenizer.json
  python scripts/bench/make_tokenizers.py --family qwen2 --out /tmp/qwen2_style_tokenizer.json

Trained on the benchmark material's English text (../shared/bench/pool_en.txt.gz, the pool the
benchmark corpora are cut from) unless --text names other files; deterministic for the same text
and arguments. What they stand in for is the cost and the id range of the real ones (128,256 and
151,665 ids, most of a document's tokens from the top of a large vocabulary); their pieces are
not the real vocabularies.

  llama3   Llama 3.x: 128,000 BPE pieces + 256 special tokens (128000 <|begin_of_text|>, 128001
           <|end_of_text|>, 128009 <|eot_id|>, ...), digits split in runs of up to 3, no
           normalizer, BOS added by the post-processor, whole words in the vocabulary kept whole
           (ignore_merges).
  qwen2    Qwen2/2.5/3: 151,643 BPE pieces + 22 special tokens (151643 <|endoftext|>, 151644
           <|im_start|>, 151645 <|im_end|>, ...), digits one by one, NFC, no BOS.

`constructed(family, pieces)` builds one of a family without training, for tests: the byte
alphabet, every pair of lowercase letters, then whole synthetic words ("Ġw" + letters) up to
`pieces`, so text made of those words encodes to ids as high as the vocabulary goes.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
POOL = os.path.join(HERE, "..", "..", "..", "shared", "bench", "pool_en.txt.gz")

# The two families' pre-tokenizer splits (their tokenizer.json's Split pattern): contractions,
# letter runs with one leading non-letter, digits (Llama 3: up to 3 at a time; Qwen2: one),
# punctuation runs, newlines, spaces.
_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}%s"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _llama3_specials(start: int) -> list[tuple[int, str, bool]]:
    named = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
             "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
             "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    named += [f"<|reserved_special_token_{i}|>" for i in range(3, 3 + 256 - len(named))]
    return [(start + i, t, True) for i, t in enumerate(named)]


def _qwen2_specials(start: int) -> list[tuple[int, str, bool]]:
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
               "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
               "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
    plain = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
             "<|repo_name|>", "<|file_sep|>"]
    # Qwen marks the tool-call and fill-in-the-middle tokens not special (decode keeps them)
    return ([(start + i, t, True) for i, t in enumerate(special)]
            + [(start + len(special) + i, t, False) for i, t in enumerate(plain)])


FAMILIES = {
    "llama3": {"pieces": 128000, "split": _SPLIT % "{1,3}", "nfc": False, "bos": "<|begin_of_text|>",
               "ignore_merges": True, "specials": _llama3_specials},
    "qwen2": {"pieces": 151643, "split": _SPLIT % "", "nfc": True, "bos": None, "ignore_merges": False,
              "specials": _qwen2_specials},
}


def _byte_level(trim_offsets: bool = False) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": trim_offsets, "use_regex": False}


def family_json(family: str, vocab: dict[str, int], merges: list[list[str]]) -> str:
    """The tokenizer.json of `family` around a BPE vocabulary (ids 0..len-1) and its merges; the
    special tokens follow the pieces (at the family's own ids for the family's piece count)."""
    fam = FAMILIES[family]
    specials = fam["specials"](len(vocab))
    post = _byte_level(True)
    if fam["bos"]:
        bos_id = next(i for i, t, _ in specials if t == fam["bos"])
        bos = fam["bos"]
        post = {"type": "Sequence", "processors": [post, {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}]}
    doc = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": special} for i, t, special in specials],
        "normalizer": {"type": "NFC"} if fam["nfc"] else None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": fam["split"]}, "behavior": "Isolated", "invert": False},
            _byte_level()]},
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": fam["ignore_merges"], "vocab": vocab, "merges": merges},
    }
    return json.dumps(doc, ensure_ascii=False)


def _load(text: str):
    import tokenizers
    return tokenizers.Tokenizer.from_str(text)


def trained(family: str, texts, pieces: int | None = None):
    """A tokenizer of `family` whose BPE pieces are trained on `texts` (an iterable of str);
    `pieces` (default: the family's count) BPE pieces, padded with unused ones when the text
    supports fewer merges, so the special tokens land where the family has them."""
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers

    fam = FAMILIES[family]
    pieces = pieces or fam["pieces"]
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(fam["split"]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if fam["nfc"]:
        tok.normalizer = tokenizers.normalizers.NFC()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=pieces, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(tok.to_str())["model"]
    vocab, merges = model["vocab"], model["merges"]
    merges = [m.split(" ") if isinstance(m, str) else m for m in merges]
    for k in range(pieces - len(vocab)):   # a short text: unused pieces, never produced
        vocab[f"<|unused_piece_{k}|>"] = len(vocab)
    return _load(family_json(family, vocab, merges))


def synthetic_word(k: int) -> str:
    """The k-th synthetic word of `constructed`: "w" + k in base 26 (letters), unique per k."""
    out = ""
    while True:
        out = chr(ord("a") + k % 26) + out
        k //= 26
        if k == 0:
            return "w" + out


def constructed(family: str, pieces: int | None = None):
    """A tokenizer of `family` without training (quick, for tests): the 256 byte pieces, every
    pair of lowercase letters (with their merges) and then whole words " w<letters>" (no merges:
    ignore_merges keeps a word that is a piece whole) up to `pieces` BPE pieces. The k-th
    synthetic word (synthetic_word(k), preceded by a space) has id 256 + 676 + k."""
    from tokenizers import pre_tokenizers

    fam = FAMILIES[family]
    pieces = pieces or fam["pieces"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    letters = "abcdefghijklmnopqrstuvwxyz"
    merges = [[a, b] for a in letters for b in letters]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    k = 0
    while len(vocab) < pieces:
        vocab["Ġ" + synthetic_word(k)] = len(vocab)   # Ġ: the byte-level space
        k += 1
    text = json.loads(family_json(family, vocab, merges))
    text["model"]["ignore_merges"] = True   # the whole words are reachable only so
    return _load(json.dumps(text, ensure_ascii=False))


def pool_texts(path: str, max_chars: float):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        paragraphs = [p.strip() for p in f.read().split("\n\x1e\n") if p.strip()]
    n = 0
    for p in paragraphs:
        if n >= max_chars:
            return
        n += len(p)
        yield p


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=sorted(FAMILIES), required=True)
    ap.add_argument("--out", required=True, help="the tokenizer.json to write")
    ap.add_argument("--text", default=POOL, help="gzipped text, paragraphs separated by \\n\\x1e\\n "
                    "(default: the benchmark pool)")
    ap.add_argument("--max-chars", type=float, default=40e6, help="characters of text to train on")
    ap.add_argument("--pieces", type=int, default=None, help="BPE pieces (default: the family's)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    tok = trained(args.family, pool_texts(args.text, args.max_chars), args.pieces)
    tok.save(args.out)
    print(f"{args.out}: {args.family}-style tokenizer, {tok.get_vocab_size()} ids "
          f"({tok.get_vocab_size(with_added_tokens=False)} BPE pieces), trained in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
