"""Training data from local text files: tokenized, packed into fixed-length rows with segment ids.

Every document becomes `[bos] + tokens + [eos]`; documents are concatenated (in a seeded order) and cut into rows of
`max_target_length` tokens. `segment_ids` number the documents inside each row from 1, so the model restarts its
KDA state and masks MLA attention at each document boundary; the loss skips targets that belong to another
document. Files are split into train / held-out by a hash of their path, so the split never changes between runs.

The batch of step s is a pure function of (seed, s): resuming at step s needs no other data position.
"""

from __future__ import annotations

import functools
import glob
import os
import zlib
from typing import NamedTuple

import numpy as np

from MaxText.tokenizer import Tokenizer


class DataError(ValueError):
    """The dataset path matches no usable file."""


def default_dataset_glob() -> str:
    """The Python standard library's top-level source files: present offline on every machine."""
    return os.path.join(os.path.dirname(os.__file__), "*.py")


def resolve_files(dataset_path: str) -> list[str]:
    """Expands `dataset_path` (paths / globs separated by commas; "" = the stdlib sources) to a sorted file list.

    Raises DataError naming the path when nothing matches or every matched file is empty.
    """
    patterns = [p.strip() for p in (dataset_path or default_dataset_glob()).split(",") if p.strip()]
    files = sorted({f for pattern in patterns for f in glob.glob(os.path.expanduser(pattern), recursive=True)
                    if os.path.isfile(f)})
    if not files:
        raise DataError(f"dataset_path={dataset_path!r} matches no file (expanded patterns: {patterns})")
    non_empty = [f for f in files if os.path.getsize(f) > 0]
    if not non_empty:
        raise DataError(f"dataset_path={dataset_path!r} matches only empty files ({len(files)} of them, e.g. "
                        f"{files[0]!r})")
    return non_empty


def split_files(files: list[str], eval_fraction: float) -> tuple[list[str], list[str]]:
    """A fixed split by a hash of each file's name; both parts non-empty when there are >= 2 files."""
    held_out = [f for f in files if zlib.crc32(os.path.basename(f).encode()) % 10_000 < eval_fraction * 10_000]
    if not held_out or len(held_out) == len(files):
        if len(files) < 2:
            raise DataError(f"need at least 2 non-empty files to hold one out for evaluation, found {files}")
        held_out = files[-1:]
    held = set(held_out)
    return [f for f in files if f not in held], held_out


class Batch(NamedTuple):
    tokens: np.ndarray  # [B, L] int32
    segment_ids: np.ndarray  # [B, L] int32, documents numbered from 1 in each row
    loss_mask: np.ndarray  # [B, L] float32: 1 where tokens[:, t+1] is the same document's next token


def pack_documents(documents: list[list[int]], row_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Concatenates documents and cuts rows of `row_length`; returns (tokens, segment_ids), each [rows, L].

    The tail shorter than a row is dropped.
    """
    tokens = np.concatenate([np.asarray(d, np.int32) for d in documents])
    doc_ids = np.concatenate([np.full(len(d), i, np.int32) for i, d in enumerate(documents)])
    rows = len(tokens) // row_length
    if rows == 0:
        raise DataError(f"the documents hold {len(tokens)} tokens, fewer than one row of max_target_length="
                        f"{row_length}")
    tokens = tokens[:rows * row_length].reshape(rows, row_length)
    doc_ids = doc_ids[:rows * row_length].reshape(rows, row_length)
    starts = np.concatenate([np.ones((rows, 1), bool), doc_ids[:, 1:] != doc_ids[:, :-1]], axis=1)
    return tokens, np.cumsum(starts, axis=1).astype(np.int32)


def to_batch(tokens: np.ndarray, segment_ids: np.ndarray) -> Batch:
    same_next = np.zeros(tokens.shape, np.float32)
    same_next[:, :-1] = segment_ids[:, 1:] == segment_ids[:, :-1]
    return Batch(tokens, segment_ids, same_next)


class PackedDataset:
    """Rows of packed documents; `batch(step)` cycles through a seeded permutation of them per epoch."""

    def __init__(self, files: list[str], tokenizer: Tokenizer, row_length: int, batch_size: int, seed: int):
        order = np.random.default_rng(seed).permutation(len(files))
        documents = []
        for i in order:
            with open(files[i], encoding="utf-8", errors="replace") as f:
                text = f.read()
            if text:
                documents.append([tokenizer.bos_id] + tokenizer.encode(text) + [tokenizer.eos_id])
        self.tokens, self.segment_ids = pack_documents(documents, row_length)
        self.batch_size = batch_size
        self.seed = seed
        self.num_tokens = self.tokens.size

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    def batch(self, step: int) -> Batch:
        """The batch of optimizer step `step` (0-based): rows step*B .. step*B+B-1 of the epoch's permutation."""
        first = step * self.batch_size
        rows = [self._epoch_order(epoch)[index]
                for epoch, index in (divmod(p, self.num_rows) for p in range(first, first + self.batch_size))]
        return to_batch(self.tokens[rows], self.segment_ids[rows])

    @functools.lru_cache(maxsize=2)
    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)

    def fixed_batches(self, count: int) -> list[Batch]:
        """The first `count` batches in file order (no shuffling): a stable held-out set."""
        batches = []
        for b in range(count):
            rows = [(b * self.batch_size + i) % self.num_rows for i in range(self.batch_size)]
            batches.append(to_batch(self.tokens[rows], self.segment_ids[rows]))
        return batches
