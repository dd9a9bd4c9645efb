"""A `datasets` dataset saved to disk as training data: its input_ids rows end to end, read from the memory-mapped
Arrow files a window at a time, or its text rows tokenized once by a local tokenizer."""

import numpy as np
import pytest
import torch

from polyshard.data.corpus import TokenBatches
from polyshard.data.saved_dataset import ChunkedTokens
from polyshard.data.token_file import check_tokens, open_tokens, tokenized
from polyshard.errors import PolyshardError
from tests.unit.test_corpus import _tokenizer

datasets = pytest.importorskip("datasets", reason="the [data] extra (part of [dev]) is not installed")

ROWS = [list(range(i * 10, i * 10 + 7 + i % 5)) for i in range(40)]  # rows of 7 to 11 ids


def _saved(tmp_path, shards: int = 2, **columns) -> str:
    path = str(tmp_path / "ds")
    datasets.Dataset.from_dict(columns or {"input_ids": ROWS}).save_to_disk(path, num_shards=shards)
    return path


class _Recording(ChunkedTokens):
    """Records the windows read."""

    def __getitem__(self, index):
        self.reads.append((index.start, index.stop))
        return super().__getitem__(index)


def test_input_ids_are_one_stream_read_from_the_mapped_files(tmp_path):
    tokens = open_tokens(_saved(tmp_path))
    whole = np.concatenate([np.array(r) for r in ROWS])
    assert len(tokens.chunks) == 2 and all(not c.flags.owndata for c in tokens.chunks)  # views of the mapping
    assert len(tokens) == len(whole) and np.array_equal(tokens[0:len(whole)], whole)
    edge = int(tokens.starts[1])
    assert np.array_equal(tokens[edge - 3:edge + 4], whole[edge - 3:edge + 4])  # a window across two files
    check_tokens(tokens, "ds", vocab_size=401, seq_len=16)
    with pytest.raises(PolyshardError, match="token id 400"):
        check_tokens(tokens, "ds", vocab_size=300, seq_len=16)


def test_a_rank_reads_only_its_rows_windows(tmp_path):
    tokens = open_tokens(_saved(tmp_path))
    x, y = next(TokenBatches(tokens, 8, 16, seed=3))
    recording = _Recording(tokens.chunks)
    recording.reads = []
    mx, my = next(TokenBatches(recording, 8, 16, seed=3, rows=slice(4, 6)))
    assert torch.equal(mx, x[4:6]) and torch.equal(my, y[4:6])
    assert len(recording.reads) == 2 and all(stop - start == 17 for start, stop in recording.reads)


def test_text_rows_are_tokenized_once(tmp_path):
    path = _saved(tmp_path, 1, text=["the cat sat on the mat .", "the dog sat ."])
    file, dtype = tokenized(path, _tokenizer(tmp_path), str(tmp_path / "data"))
    assert open_tokens(file, dtype).tolist() == [1, 2, 3, 4, 1, 5, 6, 1, 0, 3, 6]
    assert tokenized(path, _tokenizer(tmp_path), str(tmp_path / "data")) == (file, dtype)
    with pytest.raises(PolyshardError, match="no input_ids \\(its text column: add --tokenizer\\)"):
        open_tokens(path)


def test_a_dataset_of_splits_needs_a_train_split(tmp_path):
    path = str(tmp_path / "dd")
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"input_ids": ROWS})}).save_to_disk(path)
    with pytest.raises(PolyshardError, match="splits \\['test'\\] and no 'train'"):
        open_tokens(path)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"input_ids": ROWS})}).save_to_disk(str(tmp_path / "t"))
    assert len(open_tokens(str(tmp_path / "t"))) == sum(map(len, ROWS))
