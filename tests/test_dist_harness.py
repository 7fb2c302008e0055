"""The multi-process harness (tests/dist_utils.py) must not turn a failing rank into a pass: its
ranks leave with os._exit(0) after a body that passed, so a body that fails must still fail the call."""
from __future__ import annotations

import pytest
from torch.multiprocessing.spawn import ProcessRaisedException

from dist_utils import run_distributed


def body_rank1_fails(rank, world_size):
    if rank == 1:
        raise AssertionError("rank 1 found a wrong value")


def test_a_failing_rank_fails_the_call():
    with pytest.raises(ProcessRaisedException, match="rank 1 found a wrong value"):
        run_distributed(body_rank1_fails, 2)
