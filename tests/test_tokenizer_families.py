"""Llama 3's and Qwen's byte-level BPE tokenizers in the input path (data/tokenizer.py, the text
stream): their boundary tokens, and ids of 65,536 and above through packing into int32 batches.

    pytest tests/test_tokenizer_families.py -q

The tokenizers are built here (scripts/bench/make_tokenizers.py, no hub): the families' pre-tokenizer
split, normalizer, special tokens and post-processor around a constructed vocabulary.
"""
import os

import numpy as np
import pytest

import data
from data.tokenizer import BatchEncoder, load_tokenizer, special_ids
from tests.data_helpers import (
    WIDE_PIECES,
    doc_tokens,
    make_tokenizers_module,
    rows_of,
    take,
    wide_tokenizer,
    wide_words,
    write_corpus,
)


@pytest.fixture(scope="module")
def full_size():
    """Both families at their real size: {family: tokenizer}."""
    mt = make_tokenizers_module()
    return {family: mt.constructed(family) for family in ("llama3", "qwen2")}


@pytest.mark.slow
def test_boundary_tokens_at_the_families_ids(full_size):
    llama3, qwen2 = full_size["llama3"], full_size["qwen2"]
    assert llama3.get_vocab_size() == 128_256 and qwen2.get_vocab_size() == 151_665
    # Llama 3: documents end with <|end_of_text|> (not the chat turn's <|eot_id|>), start with
    # <|begin_of_text|>; Qwen: <|endoftext|> and no BOS
    assert special_ids(llama3) == (128_001, 128_000)
    assert llama3.token_to_id("<|eot_id|>") == 128_009
    assert special_ids(qwen2) == (151_643, None)
    assert qwen2.token_to_id("<|im_end|>") == 151_645
    # the special tokens in a document's text stay one id each (as the families' own files do)
    assert qwen2.encode("a<|im_end|>b", add_special_tokens=False).ids[1] == 151_645
    # Llama 3's post-processor puts BOS first; the stream encodes without it (data.add_bos decides)
    assert llama3.encode("hi").ids[0] == 128_000
    assert llama3.encode("hi", add_special_tokens=False).ids[0] != 128_000


def test_boundary_names_as_ordinary_pieces_are_not_boundaries(full_size):
    """A byte-level vocabulary may hold "</s>" or "<s>" as text (HTML, code): only the tokenizer's
    special tokens are boundaries when it marks some special."""
    for family, want in (("qwen2", (151_643, None)), ("llama3", (128_001, 128_000))):
        tok = load_tokenizer_copy(full_size[family])
        tok.add_tokens(["</s>", "<s>"])                 # ordinary (not special) pieces
        assert tok.token_to_id("</s>") is not None
        assert special_ids(tok) == want, family


def test_batch_encoder_gives_the_tokenizers_ids_and_lengths(tmp_path):
    """BatchEncoder.encode: every text's ids as the tokenizer gives them, end to end in one
    writable int32 array, with their counts (an empty text: 0), ids of 65,536 and above included."""
    tok = load_tokenizer(wide_tokenizer(tmp_path / "tokenizer.json"))
    words = wide_words()
    texts = [" ".join(words[:60]), "", "a b c", " ".join(words[-40:])]
    flat, lens = BatchEncoder(tok.to_str()).encode(texts)
    want = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    assert flat.dtype == np.int32 and flat.flags.writeable
    assert lens.tolist() == [len(w) for w in want] and lens[1] == 0
    assert flat.tolist() == [i for w in want for i in w]
    assert flat.max() >= 1 << 16


def load_tokenizer_copy(tok):
    import tokenizers
    return tokenizers.Tokenizer.from_str(tok.to_str())


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_wide_ids_stream_into_int32_batches(tmp_path, family, workers):
    """Text files tokenized on the fly by a 70k-piece tokenizer of each family: every epoch-0
    document's tokens come out whole (BOS where the family has one and data.add_bos asks), ids of
    65,536 and above included, in int32 batches."""
    tok_path = wide_tokenizer(tmp_path / "tokenizer.json", family)
    tok = load_tokenizer(tok_path)
    eos, bos = special_ids(tok)
    assert eos >= WIDE_PIECES
    texts = write_corpus(tmp_path / "text", n_files=3, docs_per_file=6, max_words=40, words=wide_words())
    files = sorted({p for p, _ in texts})
    add_bos = bos is not None
    c = data.DataConfig(paths=(os.path.join(str(tmp_path / "text"), "*", "en_head.json.gz"),), tokenizer=tok_path,
                        seq_len=32, global_batch_size=4, num_workers=workers, num_shards=4, shuffle_window=4,
                        files_per_stream=2, seed=0, add_bos=add_bos)
    data.check_files(c, 1, data.list_files(c))
    want = {key: ([bos] if add_bos else []) + tok.encode(t, add_special_tokens=False).ids + [eos]
            for key, t in texts.items()}
    n_batches = int(1.5 * sum(map(len, want.values())) / 4 / 33) + 16
    it = data.make_host_iterator(c, 0, 1, debug=True)
    batches = take(it, n_batches)
    if hasattr(it, "close"):
        it.close()
    assert all(b["inputs"].dtype == np.int32 and b["targets"].dtype == np.int32 for b in batches)
    got = {(files[f], line + 1): toks for (e, f, line), toks in doc_tokens(rows_of(batches), len(files)).items()
           if e == 0}
    assert set(got) == set(want)
    for key, toks in got.items():
        assert sorted(toks) == sorted(want[key]), key
    wide = np.concatenate([np.asarray(v) for v in want.values()])
    assert (wide >= 1 << 16).mean() > 0.15
    assert max(max(b["inputs"].max(), b["targets"].max()) for b in batches) >= eos


def test_add_bos_without_a_bos_token_is_refused(tmp_path):
    """Qwen has no BOS: data.add_bos=true says so before anything runs."""
    tok_path = wide_tokenizer(tmp_path / "tokenizer.json", "qwen2", pieces=2000)
    write_corpus(tmp_path / "text", n_files=1, docs_per_file=4)
    c = data.DataConfig(paths=(os.path.join(str(tmp_path / "text"), "*", "en_head.json.gz"),), tokenizer=tok_path,
                        seq_len=32, global_batch_size=4, num_workers=0, num_shards=1, seed=0, add_bos=True)
    with pytest.raises(ValueError, match="data.add_bos=true but tokenizer.path=.* has no BOS"):
        data.make_host_iterator(c, 0, 1)
