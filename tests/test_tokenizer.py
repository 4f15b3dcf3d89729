"""Tokenizers (MaxText/tokenizer.py): byte-level, and the tiktoken Kimi tokenizer on a small BPE built here."""

import json
import os
import re

import pytest

from end_to_end.tiny_hf import write_small_kimi_tokenizer
from MaxText import tokenizer as tok

def test_byte_tokenizer_round_trip():
    t = tok.ByteTokenizer()
    text = "def fibonacci(n): # π ≈ 3.14 🙂"
    ids = t.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert t.decode(ids) == text
    assert t.encode("a", add_bos=True) == [257, 97]
    assert t.decode([104, 105, 258, 256]) == "hi"
    assert t.decode([104, 105, 258], skip_special_tokens=False) == "hi<eos>"
    assert t.decode(list("é".encode())[:1]) == "\ufffd"  # a cut multi-byte character


def test_kimi_tokenizer_encode_decode(tmp_path):
    ids = write_small_kimi_tokenizer(str(tmp_path))
    t = tok.KimiTokenizer(str(tmp_path))
    first = ids["first_special"]
    assert t.vocab_size == first + 258
    assert (t.bos_id, t.eos_id, t.pad_id) == (first, first + 1, first + 257)
    assert t.encode("hello world") == [ids["hello"], ids[" world"]]
    assert t.encode("def fibonacci(n):") == [ids["def"], ids[" fib"], ids["onacci"], ids["(n"], ids["):"]]
    assert t.encode("你好") == [ids["你好"]]  # a Han run is one pre-token, merged to one id
    assert t.encode("hello<|im_end|>", add_bos=True) == [t.bos_id, ids["hello"], first + 2]
    assert t.special_tokens["<|reserved_token_%d|>" % (first + 3)] == first + 3
    text = "hello world, 你好! x=3.14159\n\n  tabs\tand 🙂 emoji"
    encoded = t.encode(text)
    assert t.decode(encoded) == text
    assert t.decode(encoded + [t.eos_id]) == text
    assert t.decode([ids["hello"], t.eos_id], skip_special_tokens=False) == "hello[EOS]"


def test_load_tokenizer_picks_by_files(tmp_path):
    assert isinstance(tok.load_tokenizer("", {"vocab_size": 260}), tok.ByteTokenizer)
    assert isinstance(tok.load_tokenizer(str(tmp_path), {"vocab_size": 260}), tok.ByteTokenizer)
    write_small_kimi_tokenizer(str(tmp_path))
    assert isinstance(tok.load_tokenizer(str(tmp_path), {"vocab_size": 1000}), tok.KimiTokenizer)
    with pytest.raises(tok.TokenizerError, match="vocab_size is 400"):
        tok.load_tokenizer(str(tmp_path), {"vocab_size": 400})
    with pytest.raises(tok.TokenizerError, match="vocab_size is 200"):
        tok.load_tokenizer("", {"vocab_size": 200})
    os.remove(tmp_path / tok.TOKENIZER_CONFIG_FILE)
    with pytest.raises(tok.TokenizerError, match="no tokenizer_config.json"):
        tok.load_tokenizer(str(tmp_path), {"vocab_size": 1000})


def test_kimi_tokenizer_rejects_unknown_special(tmp_path):
    write_small_kimi_tokenizer(str(tmp_path))
    path = tmp_path / tok.TOKENIZER_CONFIG_FILE
    config = json.loads(path.read_text())
    config["eos_token"] = "<|not_a_token|>"
    path.write_text(json.dumps(config))
    with pytest.raises(tok.TokenizerError, match=re.escape("eos_token='<|not_a_token|>'")):
        tok.KimiTokenizer(str(tmp_path))


def test_long_runs_are_split():
    assert list(tok._split_runs("aaaa  bb", 3)) == ["aaa", "a  bb"]
    assert "".join(tok._split_runs("x" * 10 + " " * 7, 4)) == "x" * 10 + " " * 7


def test_kimi_tokenizer_decodes_ids_past_its_vocabulary(tmp_path):
    """A model's vocabulary is padded beyond the tokenizer: such ids decode like special tokens."""
    ids = write_small_kimi_tokenizer(str(tmp_path))
    t = tok.KimiTokenizer(str(tmp_path))
    past = t.vocab_size + 5
    assert t.decode([ids["hello"], past, ids[" world"]]) == "hello world"
    assert t.decode([ids["hello"], past], skip_special_tokens=False) == f"hello<|unused_{past}|>"
