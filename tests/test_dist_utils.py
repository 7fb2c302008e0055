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


def test_a_peer_gone_during_setup_counts_as_a_signal_death():
    """gloo's 'connection closed by peer' while init_process_group sets up the group means a peer died
    (its own signal may be reported second); a body's exception or another error does not."""
    from dist_utils import _died_of_a_signal

    gone = mp.ProcessRaisedException("in init_process_group\nRuntimeError: Gloo connectFullMesh failed with "
                                     "[pair.cc:553] Connection closed by peer [127.0.0.1]:58063.", 1, 1)
    assert _died_of_a_signal(gone) is not None
    in_setup_barrier = mp.ProcessRaisedException("in _every_rank_set_up\n    dist.barrier()\nRuntimeError: [pair.cc:534]"
                                                 " Read error [127.0.0.1]:5: Connection reset by peer", 1, 1)
    assert _died_of_a_signal(in_setup_barrier) is not None
    assert _died_of_a_signal(mp.ProcessRaisedException("AssertionError: not a reason", 1, 1)) is None
    assert _died_of_a_signal(mp.ProcessRaisedException("in all_reduce: Connection closed by peer", 1, 1)) is None
