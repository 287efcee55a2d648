"""Data: byte tokens, the stable split, shards, batch streams and the file loaders."""

from __future__ import annotations

import json

import pytest
import torch

from p2pdiloco.config import DataConfig
from p2pdiloco.errors import DataError
from p2pdiloco.training.data import (
    EOS,
    BatchStream,
    Corpus,
    _sorted_sources,
    concatenate,
    decode_tokens,
    encode_text,
    heldout_batches,
    is_heldout,
    learner_batches,
    load_documents,
    stdlib_root,
)


def _sorted_by_rglob(folder, skip=("site-packages", "dist-packages", "__pycache__")):
    """The definition the early-stopping walk must match: every `*.py` file, sorted."""
    return sorted(
        p
        for p in folder.rglob("*.py")
        if p.is_file() and not set(skip).intersection(p.relative_to(folder).parts)
    )


@pytest.mark.parametrize("limit", [0, 1, 7, 60, 400])
def test_the_stdlib_walk_stops_early_and_picks_the_sorted_first_files(limit: int) -> None:
    expected = _sorted_by_rglob(stdlib_root())
    assert _sorted_sources(stdlib_root(), limit) == (expected[:limit] if limit else expected)


def test_the_walk_orders_folders_and_files_of_similar_names_as_sorted_paths(tmp_path) -> None:
    for name in ["a.py", "a/z.py", "a/b/c.py", "ab.py", "a-b/x.py", "a_/y.py", "B.py", "b.py"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "cached.py").write_text("")
    (tmp_path / "dir.py").mkdir()  # a folder named like a source is not a source
    (tmp_path / "link").symlink_to(tmp_path / "a", target_is_directory=True)
    expected = _sorted_by_rglob(tmp_path)
    for limit in range(len(expected) + 2):
        assert _sorted_sources(tmp_path, limit) == (expected[:limit] if limit else expected)


def test_byte_tokens_round_trip_utf8() -> None:
    text = "def f(x):\n    return 'héllo ✓'"
    tokens = encode_text(text)
    assert tokens.max() < 256
    assert decode_tokens(tokens) == text


def test_split_is_by_file_stable_and_disjoint(tiny_corpus: Corpus) -> None:
    train_keys = {d.key for d in tiny_corpus.train}
    heldout_keys = {d.key for d in tiny_corpus.heldout}
    assert train_keys and heldout_keys and not train_keys & heldout_keys
    again = Corpus.from_config(DataConfig(max_files=120))
    assert [d.key for d in again.heldout] == [d.key for d in tiny_corpus.heldout]
    # The split depends only on the key, not on what else is in the corpus.
    assert all(is_heldout(k, 0.05) for k in heldout_keys if len(tiny_corpus.heldout) > 1)


def test_heldout_fraction_is_roughly_respected() -> None:
    keys = [f"pkg/module_{i}.py" for i in range(4000)]
    share = sum(is_heldout(k, 0.1) for k in keys) / len(keys)
    assert 0.08 < share < 0.12


def test_shards_partition_the_training_files(tiny_corpus: Corpus) -> None:
    shards = [tiny_corpus.shard(i, 3, seed=0) for i in range(3)]
    keys = [d.key for shard in shards for d in shard]
    assert sorted(keys) == sorted(d.key for d in tiny_corpus.train)
    assert len(set(keys)) == len(keys)
    assert {d.key for d in tiny_corpus.shard(0, 3, seed=1)} != {d.key for d in shards[0]}


def test_learner_streams_are_deterministic_and_differ(tiny_corpus: Corpus) -> None:
    a1 = next(learner_batches(tiny_corpus, 0, 2, 4, 32, seed=0))
    a2 = next(learner_batches(tiny_corpus, 0, 2, 4, 32, seed=0))
    b = next(learner_batches(tiny_corpus, 1, 2, 4, 32, seed=0))
    assert a1.shape == (4, 33) and a1.dtype == torch.long
    assert torch.equal(a1, a2) and not torch.equal(a1, b)
    assert int(a1.max()) <= EOS


def test_batch_stream_covers_every_chunk_once_per_epoch() -> None:
    tokens = torch.arange(100, dtype=torch.int16)
    stream = BatchStream(tokens, batch_size=2, seq_len=9, seed=0)  # 10 chunks of 10
    starts = sorted(int(row[0]) for _ in range(5) for row in next(stream))
    assert starts == list(range(0, 100, 10))


def test_heldout_batches_are_fixed(tiny_corpus: Corpus) -> None:
    a = heldout_batches(tiny_corpus, 2, 4, 32)
    b = heldout_batches(tiny_corpus, 2, 4, 32)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_concatenate_separates_documents_with_eos(tiny_corpus: Corpus) -> None:
    docs = tiny_corpus.train[:3]
    stream = concatenate(docs, order_seed=0)
    assert int((stream == EOS).sum()) == 3
    assert stream.numel() == sum(len(d.text.encode()) for d in docs) + 3


def test_loaders_for_txt_jsonl_and_parquet(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("plain text file")
    (tmp_path / "b.jsonl").write_text(
        json.dumps({"body": "one"}) + "\n\n" + json.dumps({"body": "two"}) + "\n"
    )
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["three", "four"]}), tmp_path / "c.parquet")
    docs = load_documents(DataConfig(source=str(tmp_path), text_field="body"))
    texts = sorted(d.text for d in docs)
    assert texts == ["four", "one", "plain text file", "three", "two"]
    assert len({d.key for d in docs}) == 5


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.mkdir(), "holds no"),
        (lambda p: p.with_suffix(".txt").write_text(""), "is empty"),
    ],
)
def test_missing_or_empty_data_names_the_path(tmp_path, setup, message) -> None:
    target = tmp_path / "corpus"
    setup(target)
    source = target.with_suffix(".txt") if message == "is empty" else target
    with pytest.raises(DataError) as info:
        load_documents(DataConfig(source=str(source)))
    assert message in str(info.value) and str(source) in str(info.value)


def test_bad_jsonl_line_names_file_and_line(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok"}\n{"nope": 1}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: no string field 'text'"):
        load_documents(DataConfig(source=str(path)))


def test_hf_source_without_datasets_is_a_clear_error(monkeypatch) -> None:
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(DataError, match=r"pip install 'p2pdiloco\[hf\]'"):
        load_documents(DataConfig(source="hf:some/dataset"))
