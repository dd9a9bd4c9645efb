import pytest
import torch

from polyshard.data.corpus import VOCAB_SIZE, TokenBatches, load_corpus
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
