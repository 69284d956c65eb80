"""AG News from its CSV files (``train.csv``, ``test.csv``: class 1..4, title, description).

Text is lower-cased and split into words and numbers; the vocabulary is built from ``train.csv``
(id 0 = padding, 1 = unknown) and every text is cut or padded to ``max_len`` tokens (PFLlib: 200).
"""

from __future__ import annotations

import csv
import re
from collections import Counter
from pathlib import Path

import numpy as np

from .base import DataError, Dataset, require_file

_HOW = ("Download ag_news_csv (train.csv and test.csv, rows: class index 1-4, title, description) "
        "and pass --data-dir with the folder that holds them.")
_TOKEN = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
PAD, UNK = 0, 1
CLASSES = ("World", "Sports", "Business", "Sci/Tech")


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


def _read_csv(path: Path) -> tuple[list[list[str]], list[int]]:
    texts, labels = [], []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            for lineno, row in enumerate(csv.reader(f), 1):
                if not row:
                    continue
                if len(row) < 2 or not row[0].strip().isdigit() or not 1 <= int(row[0]) <= 4:
                    raise DataError(f"agnews: {path}:{lineno}: expected 'class(1-4),title,description', "
                                    f"got {','.join(row)[:80]!r}")
                labels.append(int(row[0]) - 1)
                texts.append(tokenize(" ".join(row[1:])))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"agnews: {path} is not a UTF-8 CSV file ({exc}). {_HOW}") from exc
    if not labels:
        raise DataError(f"agnews: {path} holds no rows. {_HOW}")
    return texts, labels


def build_vocab(texts: list[list[str]], max_size: int | None = None, min_freq: int = 1) -> dict[str, int]:
    counts = Counter(tok for t in texts for tok in t)
    words = sorted((w for w, c in counts.items() if c >= min_freq), key=lambda w: (-counts[w], w))
    if max_size is not None:
        words = words[: max(0, max_size - 2)]
    return {w: i + 2 for i, w in enumerate(words)}


def encode(texts: list[list[str]], vocab: dict[str, int], max_len: int) -> np.ndarray:
    out = np.zeros((len(texts), max_len), dtype=np.int64)
    for i, toks in enumerate(texts):
        ids = [vocab.get(t, UNK) for t in toks[:max_len]]
        out[i, : len(ids)] = ids
    return out


def load_agnews(directory: Path, max_len: int = 200, max_vocab: int | None = None) -> Dataset:
    if not directory.is_dir():
        raise DataError(f"agnews: data directory {directory} does not exist. {_HOW}")
    train_t, train_y = _read_csv(require_file(directory / "train.csv", "agnews", _HOW))
    test_t, test_y = _read_csv(require_file(directory / "test.csv", "agnews", _HOW))
    vocab = build_vocab(train_t, max_vocab)
    x = np.concatenate([encode(train_t, vocab, max_len), encode(test_t, vocab, max_len)])
    y = np.asarray(train_y + test_y, dtype=np.int64)
    return Dataset(name="agnews", x=x, y=y, num_classes=4, vocab_size=len(vocab) + 2, class_names=CLASSES)
