"""A learner over several processes: how a process finds its place (torchrun's environment).

The ranks training together in a swarm are tested with real processes in
tests/net/test_multiproc.py.
"""

from __future__ import annotations

import pytest

from p2pdiloco.errors import ConfigError
from p2pdiloco.training.ranks import RankInfo, detect_ranks


def test_a_process_without_torchrun_is_a_single_process_learner() -> None:
    assert detect_ranks({}) is None
    assert detect_ranks({"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}) is None


def test_torchrun_ranks_are_read_and_rank_zero_leads() -> None:
    info = detect_ranks({"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "0"})
    assert info == RankInfo(rank=2, world_size=4, local_rank=0)
    assert not info.is_lead
    assert detect_ranks({"WORLD_SIZE": "2", "RANK": "0"}).is_lead


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"WORLD_SIZE": "two"}, "must be integers"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, r"RANK must be in \[0, 2\), got 2"),
    ],
)
def test_a_broken_environment_is_a_user_error(environ, message) -> None:
    with pytest.raises(ConfigError, match=message):
        detect_ranks(environ)
