import pytest

from tests.distributed.pool import pools_by_world


@pytest.fixture(scope="session")
def pools():
    """Rank pools by world size, created on first use and shared by every test."""
    with pools_by_world() as get:
        yield get
