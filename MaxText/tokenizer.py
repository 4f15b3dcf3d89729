"""Tokenizers: byte-level (the tiny configs) and the tiktoken-based Kimi tokenizer (converted checkpoints).

    tokenizer = load_tokenizer(checkpoint_dir_or_empty, config)
    ids = tokenizer.encode("def fibonacci(n):")      # list[int]
    text = tokenizer.decode(ids)                      # str

`load_tokenizer` picks the Kimi tokenizer when `tiktoken.model` and `tokenizer_config.json` sit in the directory
(the converter copies them next to the checkpoint), and the byte-level one otherwise.

Kimi tokenizer (the release's tokenization_kimi.py, reimplemented on tiktoken): BPE ranks from `tiktoken.model`
(lines of base64 token + rank), the release's split pattern, and 258 special ids right after the BPE ids, named by
`tokenizer_config.json`'s `added_tokens_decoder` (unnamed ones are `<|reserved_token_{id}|>`); bos / eos / pad are
the tokens named by its `bos_token` / `eos_token` / `pad_token`. Special-token text in a prompt encodes to the
special id, as in the release.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


class Tokenizer(Protocol):
    """What decoding needs from a tokenizer."""
    vocab_size: int  # ids are in [0, vocab_size)
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class TokenizerError(ValueError):
    """Tokenizer files are missing or inconsistent, or do not fit the model's vocabulary."""


# ------------------------------------------------------------------------------------------------ byte-level


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then pad 256, bos 257, eos 258 (vocab 259; the tiny config's is 260)."""
    vocab_size = 259
    pad_id, bos_id, eos_id = 256, 257, 258

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return ([self.bos_id] if add_bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Bytes back to text (invalid UTF-8, e.g. a cut multi-byte character, becomes U+FFFD). Special ids are
        dropped, or shown as <pad> / <bos> / <eos> when `skip_special_tokens` is False; ids >= 259 as <id>."""
        names = {self.pad_id: "<pad>", self.bos_id: "<bos>", self.eos_id: "<eos>"}
        out, pending = [], bytearray()
        for token in ids:
            if 0 <= token < 256:
                pending.append(token)
                continue
            out.append(pending.decode("utf-8", errors="replace"))
            pending = bytearray()
            if not skip_special_tokens:
                out.append(names.get(token, f"<{token}>"))
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)


# ------------------------------------------------------------------------------------------------ Kimi (tiktoken)

# The release's split pattern (tokenization_kimi.py `pat_str`).
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_SPECIAL_IDS = 256 + 2  # the release reserves this many ids after the BPE ranks
MAX_ENCODE_CHARS = 400_000  # tiktoken's safe input length per call
MAX_RUN_CHARS = 25_000  # longest run of (non-)whitespace passed to tiktoken at once


def _token_content(value: Any) -> str | None:
    """A tokenizer_config.json token entry: a string or an AddedToken dict {"content": ...}."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


def _split_runs(text: str, limit: int) -> Iterator[str]:
    """Splits `text` so no piece holds more than `limit` consecutive whitespace or non-whitespace characters."""
    start, run, in_space = 0, 0, text[:1].isspace()
    for i, char in enumerate(text):
        if char.isspace() != in_space:
            run, in_space = 1, char.isspace()
        else:
            run += 1
            if run > limit:
                yield text[start:i]
                start, run = i, 1
    yield text[start:]


class KimiTokenizer:
    """The Kimi-Linear tiktoken tokenizer from a directory holding tiktoken.model + tokenizer_config.json."""

    def __init__(self, directory: str):
        import tiktoken  # pylint: disable=import-outside-toplevel
        from tiktoken.load import load_tiktoken_bpe  # pylint: disable=import-outside-toplevel
        with open(os.path.join(directory, TOKENIZER_CONFIG_FILE), encoding="utf-8") as f:
            tok_config = json.load(f)
        ranks = load_tiktoken_bpe(os.path.join(directory, TIKTOKEN_FILE))
        named = {int(i): _token_content(v) for i, v in (tok_config.get("added_tokens_decoder") or {}).items()}
        first = len(ranks)
        self.special_tokens = {named.get(i) or f"<|reserved_token_{i}|>": i
                               for i in range(first, first + NUM_SPECIAL_IDS)}
        self.encoding = tiktoken.Encoding(name=os.path.basename(directory) or "kimi", pat_str=KIMI_PATTERN,
                                          mergeable_ranks=ranks, special_tokens=self.special_tokens)
        self.vocab_size = self.encoding.n_vocab
        self.bos_id = self._special_id(tok_config, "bos_token", "[BOS]")
        self.eos_id = self._special_id(tok_config, "eos_token", "[EOS]")
        self.pad_id = self._special_id(tok_config, "pad_token", None)

    def _special_id(self, tok_config: Mapping[str, Any], key: str, default: str | None) -> int | None:
        content = _token_content(tok_config.get(key)) or default
        if content is None:
            return None
        if content not in self.special_tokens:
            ids = sorted(self.special_tokens.values())
            raise TokenizerError(f"{TOKENIZER_CONFIG_FILE} names {key}={content!r}, which is not one of the special "
                                 f"tokens (ids {ids[0]}..{ids[-1]})")
        return self.special_tokens[content]

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Text -> ids; special-token text (e.g. '<|im_end|>') becomes its special id, as in the release."""
        ids = [self.bos_id] if add_bos and self.bos_id is not None else []
        for i in range(0, len(text), MAX_ENCODE_CHARS):
            for piece in _split_runs(text[i:i + MAX_ENCODE_CHARS], MAX_RUN_CHARS):
                ids.extend(self.encoding.encode(piece, allowed_special="all"))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids -> text. Ids past the tokenizer (a model's vocabulary is often padded beyond it) count as special:
        dropped, or shown as <|unused_ID|> when `skip_special_tokens` is False."""
        special = set(self.special_tokens.values())
        pieces, run = [], []
        for token in ids:
            if token in special or not 0 <= token < self.vocab_size:
                if not skip_special_tokens:
                    pieces.append(self.encoding.decode(run))
                    run = []
                    pieces.append(self.encoding.decode([token]) if token in special else f"<|unused_{token}|>")
                continue
            run.append(token)
        return "".join(pieces) + self.encoding.decode(run)


# ------------------------------------------------------------------------------------------------ choice


def load_tokenizer(directory: str, config: Mapping[str, Any]) -> Tokenizer:
    """The Kimi tokenizer when `directory` holds tiktoken.model and tokenizer_config.json, else byte-level
    (also for `directory` == ''). Raises TokenizerError when tiktoken.model lacks its tokenizer_config.json or
    the tokenizer's ids do not fit `config['vocab_size']`."""
    has = {name: bool(directory) and os.path.isfile(os.path.join(directory, name))
           for name in (TIKTOKEN_FILE, TOKENIZER_CONFIG_FILE)}
    if has[TIKTOKEN_FILE] and not has[TOKENIZER_CONFIG_FILE]:
        raise TokenizerError(f"{directory} holds {TIKTOKEN_FILE} but no {TOKENIZER_CONFIG_FILE}; the Kimi tokenizer "
                             f"needs both (copy them from the HF checkpoint)")
    tokenizer: Tokenizer = KimiTokenizer(directory) if has[TIKTOKEN_FILE] else ByteTokenizer()
    if tokenizer.vocab_size > config["vocab_size"]:
        raise TokenizerError(f"the {type(tokenizer).__name__} has {tokenizer.vocab_size} ids but the model's "
                             f"vocab_size is {config['vocab_size']}; ids would fall outside the embedding")
    return tokenizer
