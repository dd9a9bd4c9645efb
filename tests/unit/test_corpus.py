from pathlib import Path

import numpy as np
import pytest
import torch

from polyshard.data.ahead import Ahead
from polyshard.data.corpus import VOCAB_SIZE, TokenBatches, load_corpus
from polyshard.data.token_file import check_tokens, open_tokens, tokenized
from polyshard.errors import PolyshardError


def test_corpus_is_bytes():
    tokens = load_corpus()
    assert tokens.dtype == torch.long and tokens.dim() == 1
    assert len(tokens) > 100_000
    assert 0 <= int(tokens.min()) and int(tokens.max()) < VOCAB_SIZE
    assert load_corpus() is tokens


def test_batches_are_deterministic():
    a, b = TokenBatches(load_corpus(), 4, 32, seed=7), TokenBatches(load_corpus(), 4, 32, seed=7)
    for _ in range(3):
        (xa, ya), (xb, yb) = next(a), next(b)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    x, _ = next(TokenBatches(load_corpus(), 4, 32, seed=8))
    assert not torch.equal(x, next(TokenBatches(load_corpus(), 4, 32, seed=7))[0])


def test_targets_are_inputs_shifted_by_one():
    x, y = next(iter(TokenBatches(load_corpus(), 3, 16, seed=0)))
    assert x.shape == y.shape == (3, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_windows_fit_a_tiny_corpus():
    tokens = torch.arange(5)
    x, y = next(TokenBatches(tokens, 64, 4, seed=0))
    assert torch.equal(x[0], torch.arange(4)) and torch.equal(y[0], torch.arange(1, 5))


@pytest.mark.parametrize("batch_size, seq_len", [(0, 8), (2, 0), (2, 5)])
def test_bad_sizes(batch_size, seq_len):
    with pytest.raises(PolyshardError):
        TokenBatches(torch.arange(5), batch_size, seq_len, seed=0)


class _Recording(np.ndarray):
    """A token array that records the slices read from it."""

    reads: list

    def __getitem__(self, index):
        if isinstance(index, slice):
            self.reads.append((index.start, index.stop))
        return super().__getitem__(index)


def test_a_rank_reads_only_its_rows_of_a_token_file(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    tokens = open_tokens(str(path))
    whole = TokenBatches(tokens, 8, 16, seed=3)
    x, y = next(whole)
    recording = np.asarray(tokens).view(_Recording)
    recording.reads = []
    mine = TokenBatches(recording, 8, 16, seed=3, rows=slice(4, 6))
    mx, my = next(mine)
    assert torch.equal(mx, x[4:6]) and torch.equal(my, y[4:6])
    assert len(recording.reads) == 2 and all(stop - start == 17 for start, stop in recording.reads)
    assert torch.equal(next(TokenBatches(load_corpus(), 8, 16, seed=3, rows=slice(4, 6)))[0],
                       next(TokenBatches(load_corpus(), 8, 16, seed=3))[0][4:6])


def test_a_stage_that_takes_no_data_reads_none_and_stays_in_step():
    tokens = np.arange(1000, dtype=np.uint16)
    untouched = tokens.view(_Recording)
    untouched.reads = []
    idle, reading = TokenBatches(untouched, 8, 16, seed=3, rows=slice(2, 4), read=False), TokenBatches(tokens, 8, 16, seed=3)
    for _ in range(2):
        x, y = next(idle)
        assert x.shape == y.shape == (2, 16) and not x.any() and not y.any() and untouched.reads == []
        next(reading)
        assert torch.equal(idle.position(), reading.position())


@pytest.mark.parametrize("content, dtype, message", [
    (b"", "uint16", "0 bytes"),
    (b"abc", "uint16", "3 bytes, not a whole number of uint16"),
    (b"abcdef", "uint32", "6 bytes, not a whole number of uint32"),
])
def test_what_cannot_be_a_token_file_is_refused(tmp_path, content, dtype, message):
    (tmp_path / "t.bin").write_bytes(content)
    with pytest.raises(PolyshardError, match=message):
        open_tokens(str(tmp_path / "t.bin"), dtype)


def test_token_ids_must_fit_the_vocabulary_and_a_window(tmp_path):
    np.array([1, 2, 300, 4], dtype=np.uint16).tofile(tmp_path / "t.bin")
    tokens = open_tokens(str(tmp_path / "t.bin"))
    with pytest.raises(PolyshardError, match="holds token id 300, but the model's vocabulary has 256"):
        check_tokens(tokens, "t.bin", vocab_size=256, seq_len=2)
    with pytest.raises(PolyshardError, match="holds 4 tokens"):
        check_tokens(tokens, "t.bin", vocab_size=512, seq_len=8)


def test_batches_drawn_ahead_resume_at_the_batch_not_yet_handed_out():
    ahead = Ahead(TokenBatches(load_corpus(), 4, 16, seed=5))
    plain = TokenBatches(load_corpus(), 4, 16, seed=5)
    for _ in range(3):
        assert torch.equal(next(ahead)[0], next(plain)[0])
    saved = ahead.position()  # the fourth batch is already drawn in the background
    fourth, fifth = next(ahead)[0], next(ahead)[0]
    ahead.seek(saved)
    assert torch.equal(next(ahead)[0], fourth) and torch.equal(next(ahead)[0], fifth)
    ahead.close()


def _tokenizer(tmp_path) -> str:
    """A word-level tokenizer.json of our own: nothing downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "the", "cat", "sat", "on", "mat", "."]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    return str(tmp_path / "tokenizer.json")


def test_a_text_file_is_tokenized_once_into_a_token_file(tmp_path):
    text = tmp_path / "story.txt"
    text.write_text("the cat sat on the mat .\nthe dog sat .\n")
    path, dtype = tokenized(str(text), _tokenizer(tmp_path), str(tmp_path / "data"))
    assert dtype == "uint16"
    assert open_tokens(path, dtype).tolist() == [1, 2, 3, 4, 1, 5, 6, 1, 0, 3, 6]  # "dog" is unknown
    stamp = Path(path).stat().st_mtime_ns
    assert tokenized(str(text), str(tmp_path), str(tmp_path / "data")) == (path, dtype)  # a folder works too
    assert Path(path).stat().st_mtime_ns == stamp  # found, not written again
    text.write_text("the mat .\n")
    assert tokenized(str(text), str(tmp_path), str(tmp_path / "data"))[0] != path  # new text, new file
    with pytest.raises(PolyshardError, match="neither a tokenizer.json nor a folder"):
        tokenized(str(text), str(tmp_path / "none"), str(tmp_path / "data"))
