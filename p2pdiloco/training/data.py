"""Training text: byte-level tokens, corpora split by file, deterministic per-learner batches.

The embedded default corpus is the source of the running Python's standard library,
which every installation carries, so a first run works offline. Files are split into
train / held-out by a stable hash of their relative path (the same split on every peer
and every run); each learner reads its own shard in its own seeded order.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from p2pdiloco.config import DataConfig
from p2pdiloco.errors import DataError

EOS = 256
"""End-of-document token, placed between concatenated files."""
VOCAB_SIZE = 257
"""Bytes 0..255 plus EOS."""

TEXT_SUFFIXES = (".txt", ".md", ".py", ".jsonl", ".parquet")


def encode_text(text: str) -> torch.Tensor:
    """Byte-level tokens (uint8 values as int64) of a string, UTF-8 encoded."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def decode_tokens(tokens: torch.Tensor) -> str:
    """Text of byte-level tokens; EOS becomes a newline, invalid UTF-8 is replaced."""
    raw = bytes(10 if t == EOS else int(t) for t in tokens.tolist())
    return raw.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Document:
    """One unit of the train / held-out split (a file, or a record of a dataset)."""

    key: str
    """Stable identifier used for the split: relative path, or path#record."""
    text: str


def is_heldout(key: str, heldout_fraction: float) -> bool:
    """Stable split: a document is held out when the hash of its key falls below the fraction."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < heldout_fraction


def shard_of(key: str, num_shards: int, seed: int) -> int:
    """Which of `num_shards` shards a document belongs to, for a given data seed."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % num_shards


def stdlib_root() -> Path:
    """Folder of the running interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


Progress = Callable[[int, int], None]
"""Progress callback: (files read, files in all)."""


_STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "__pycache__"})


def _sorted_sources(folder: Path, limit: int) -> list[Path]:
    """The first `limit` (0: all) `*.py` files under `folder` in sorted-path order.

    A depth-first walk with each folder's entries sorted by name yields paths in the order
    `sorted(folder.rglob("*.py"))` gives them, so it can stop at `limit` files instead of
    listing the whole library (~1 s of every peer's start). Like rglob, it does not enter
    links to folders; it skips `_STDLIB_SKIP` folders.
    """
    found: list[Path] = []

    def walk(current: Path) -> bool:
        with os.scandir(current) as listing:
            entries = sorted(listing, key=lambda entry: entry.name)
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                if entry.name not in _STDLIB_SKIP and walk(Path(entry.path)):
                    return True
            elif entry.name.endswith(".py") and entry.is_file():
                found.append(Path(entry.path))
                if len(found) == limit:
                    return True
        return False

    walk(folder)
    return found


def _stdlib_documents(max_files: int, progress: Progress | None = None) -> Iterator[Document]:
    root = stdlib_root()
    paths = _sorted_sources(root, max_files)
    if not paths:
        raise DataError(
            f"no Python sources found under {root}; pass data.source=PATH to your own text"
        )
    for done, path in enumerate(paths, start=1):
        if progress:
            progress(done, len(paths))
        text = path.read_text(encoding="utf-8", errors="replace")
        if text:
            yield Document(str(path.relative_to(root)), text)


def _jsonl_documents(path: Path, rel: str, text_field: str) -> Iterator[Document]:
    with path.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise DataError(f"{path}:{number}: not a JSON object") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise DataError(
                    f"{path}:{number}: no string field {text_field!r} (set data.text_field)"
                )
            yield Document(f"{rel}#{number}", record[text_field])


def _parquet_documents(path: Path, rel: str, text_field: str) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    try:
        table = pq.read_table(path, columns=[text_field])
    except (OSError, KeyError, ValueError) as exc:
        raise DataError(f"{path}: cannot read column {text_field!r} ({exc})") from None
    for number, text in enumerate(table.column(text_field).to_pylist()):
        if isinstance(text, str):
            yield Document(f"{rel}#{number}", text)


def _file_documents(path: Path, rel: str, text_field: str) -> Iterator[Document]:
    if path.suffix == ".jsonl":
        yield from _jsonl_documents(path, rel, text_field)
    elif path.suffix == ".parquet":
        yield from _parquet_documents(path, rel, text_field)
    else:
        yield Document(rel, path.read_text(encoding="utf-8", errors="replace"))


def _path_documents(
    source: Path, text_field: str, max_files: int, progress: Progress | None = None
) -> Iterator[Document]:
    if not source.exists():
        raise DataError(f"data source {source} does not exist")
    if source.is_dir():
        paths = sorted(p for p in source.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not paths:
            raise DataError(f"data source {source} holds no {'/'.join(TEXT_SUFFIXES)} files")
        root = source
    else:
        paths, root = [source], source.parent
    paths = paths[: max_files or None]
    for done, path in enumerate(paths, start=1):
        if progress:
            progress(done, len(paths))
        try:
            yield from _file_documents(path, str(path.relative_to(root)), text_field)
        except OSError as exc:
            raise DataError(f"cannot read {path}: {exc.strerror or exc}") from None


def _hf_documents(name: str, text_field: str, max_files: int) -> Iterator[Document]:
    try:
        import datasets
    except ImportError:
        raise DataError(
            "data.source=hf:... needs the hf extra: pip install 'p2pdiloco[hf]'"
        ) from None
    dataset = datasets.load_dataset(name, split="train", streaming=True)
    limit = max_files or 100_000
    for number, record in enumerate(dataset):
        if number >= limit:
            break
        text = record.get(text_field)
        if isinstance(text, str):
            yield Document(f"{name}#{number}", text)


def load_documents(config: DataConfig, progress: Progress | None = None) -> list[Document]:
    """All documents of the configured source; raises `DataError` naming the path if none."""
    source = config.source
    if source == "stdlib":
        docs = list(_stdlib_documents(config.max_files, progress))
    elif source.startswith("hf:"):
        docs = list(_hf_documents(source[3:], config.text_field, config.max_files))
    else:
        docs = list(
            _path_documents(
                Path(source).expanduser(), config.text_field, config.max_files, progress
            )
        )
    docs = [d for d in docs if d.text]
    if not docs:
        raise DataError(f"data source {source} is empty: it holds no text")
    return docs


@dataclass(frozen=True)
class Corpus:
    """Documents of one source, split into train and held-out by stable hash."""

    train: list[Document]
    heldout: list[Document]

    @classmethod
    def from_config(cls, config: DataConfig, progress: Progress | None = None) -> Corpus:
        docs = load_documents(config, progress)
        heldout = [d for d in docs if is_heldout(d.key, config.heldout_fraction)]
        train = [d for d in docs if not is_heldout(d.key, config.heldout_fraction)]
        if not heldout:  # tiny corpora: keep evaluation possible, deterministically
            heldout, train = train[-1:], train[:-1] or train[-1:]
        if not train:
            raise DataError(
                f"data source {config.source} has no training documents after the split"
            )
        return cls(train=train, heldout=heldout)

    def shard(self, index: int, num_shards: int, seed: int) -> list[Document]:
        """Training documents of shard `index` of `num_shards` (all of them when 1)."""
        if num_shards <= 1:
            return list(self.train)
        docs = [d for d in self.train if shard_of(d.key, num_shards, seed) == index]
        return docs or list(self.train)


def concatenate(docs: list[Document], order_seed: int) -> torch.Tensor:
    """One token stream: the documents in a seeded order, each followed by EOS (uint8 + EOS as int16)."""
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(order_seed)).tolist()
    parts: list[torch.Tensor] = []
    eos = torch.tensor([EOS], dtype=torch.int16)
    for index in order:
        raw = docs[index].text.encode("utf-8")
        parts.append(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int16))
        parts.append(eos)
    return torch.cat(parts)


class BatchStream:
    """Endless deterministic batches of (batch_size, seq_len + 1) token windows.

    Windows are taken in order from a seeded permutation of non-overlapping chunks, so
    one epoch sees every chunk once; the next epoch reshuffles.
    """

    def __init__(self, tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int) -> None:
        window = seq_len + 1
        if tokens.numel() < window:
            raise DataError(
                f"corpus of {tokens.numel()} tokens is shorter than one sequence of {window}"
            )
        self.tokens = tokens
        self.batch_size = batch_size
        self.window = window
        self.num_chunks = tokens.numel() // window
        self.generator = torch.Generator().manual_seed(seed)
        self._order = torch.empty(0, dtype=torch.long)
        self._position = 0

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> torch.Tensor:
        rows = []
        for _ in range(self.batch_size):
            if self._position >= self._order.numel():
                self._order = torch.randperm(self.num_chunks, generator=self.generator)
                self._position = 0
            start = int(self._order[self._position]) * self.window
            self._position += 1
            rows.append(self.tokens[start : start + self.window])
        return torch.stack(rows).long()


def learner_batches(
    corpus: Corpus, rank: int, num_shards: int, batch_size: int, seq_len: int, seed: int
) -> BatchStream:
    """The batch stream of learner `rank`: its own shard, in its own order."""
    docs = corpus.shard(rank % max(num_shards, 1), num_shards, seed)
    learner_seed = seed * 1_000_003 + rank
    return BatchStream(concatenate(docs, learner_seed), batch_size, seq_len, learner_seed)


def heldout_batches(
    corpus: Corpus, num_batches: int, batch_size: int, seq_len: int
) -> list[torch.Tensor]:
    """A fixed list of held-out batches: the same on every peer, for comparable losses."""
    stream = BatchStream(concatenate(corpus.heldout, 0), batch_size, seq_len, seed=12345)
    return [next(stream) for _ in range(num_batches)]
