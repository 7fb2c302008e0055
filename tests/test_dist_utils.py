"""tests/dist_utils.run_distributed: a rank dying of a signal is run again once; twice fails."""
from __future__ import annotations

import os
import signal

import pytest
import torch.multiprocessing as mp

from dist_utils import run_distributed


def body_abort_once(rank, ws, marker):
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGABRT)


def body_abort_always(rank, ws):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGABRT)


def body_raises(rank, ws):
    raise AssertionError("a rank's exception is not a reason to run again")


def test_a_rank_killed_by_a_signal_runs_again_once(tmp_path):
    run_distributed(body_abort_once, 2, str(tmp_path / "aborted"))
    with pytest.raises(mp.ProcessExitedException, match="SIGABRT"):
        run_distributed(body_abort_always, 2)
    with pytest.raises(mp.ProcessRaisedException, match="not a reason to run again"):
        run_distributed(body_raises, 2)
