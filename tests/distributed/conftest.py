import pytest

from tests.distributed.pool import RankPool


@pytest.fixture(scope="session")
def pools():
    """Rank pools by world size, created on first use and shared by every test."""
    made: dict[int, RankPool] = {}

    def get(world: int) -> RankPool:
        if world not in made:
            made[world] = RankPool(world)
        return made[world]

    yield get
    for pool in made.values():
        pool.close()
