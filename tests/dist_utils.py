"""Run a test body in ``world_size`` spawned processes joined by a gloo process group (CPU).

    run_distributed(body, 2, *args)      # body(rank, world_size, *args) in every process

``body`` must be a module-level function (spawned children import it by name). An exception in
any rank fails the call with that rank's traceback; a run past ``timeout_s`` is killed. Every
spawn costs a few seconds (a fresh interpreter importing torch): group cases into one body.
"""
from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 60   # a rank stuck in a collective fails instead of hanging the suite


def _every_rank_set_up() -> None:
    """A barrier, named so that a failure in it reads as one during setup (see _died_of_a_signal)."""
    dist.barrier()


def _entry(rank: int, body, world_size: int, init_file: str, args: tuple) -> None:
    torch.set_num_threads(1)  # the CI machine has 2 cores for all ranks
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    # Every rank finishes setting up the group before any body runs: gloo's connectFullMesh can return
    # in one rank while a peer is still connecting, and a rank whose body is short (or empty) would
    # otherwise exit and close its sockets under that peer ("Connection closed by peer" in its
    # init_process_group; it failed test_a_rank_killed_by_a_signal_runs_again_once in CI at 71242d7).
    _every_rank_set_up()
    try:
        body(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    # Leave without interpreter finalization. destroy_process_group does not join gloo's worker
    # threads while anything (DeviceMesh, Dynamo's caches) still holds the group, and a worker drops
    # its last reference to a finished collective (and so frees the Python tensors it holds) after
    # waking the caller; when that lands during finalization, taking the GIL ends the thread inside
    # a noexcept destructor and the rank dies of SIGABRT ("terminate called without an active
    # exception") after the body passed. A failing body never gets here: it raises to spawn, which
    # reports its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(body, world_size: int = 2, *args, timeout_s: float = 240) -> None:
    """A rank killed by a signal (no Python exception: a SIGSEGV, and a SIGABRT from glibc's "malloc():
    unaligned tcache chunk detected", seen twice in about a dozen full CPU runs, each in a different
    gloo test that then passed on rerun), or a rank whose peer went away while gloo set up the group
    (seen twice in a full CPU run's rerun of test_dist_utils), gets the whole run repeated once, with a
    line on stderr; a second such failure, any other exception raised by a rank, and a timeout fail the
    test."""
    try:
        _run_once(body, world_size, args, timeout_s)
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as exc:
        why = _died_of_a_signal(exc)
        if why is None:
            raise
        print(f"run_distributed: {body.__name__}: {why}; running it again", file=sys.stderr, flush=True)
        _run_once(body, world_size, args, timeout_s)


# what gloo raises in a rank whose peer died while the group was being set up (the peer's own signal
# may be reported second: spawn raises the first failure it sees)
_PEER_GONE = ("Gloo connectFullMesh failed", "Connection closed by peer", "Connection reset by peer")
_SETUP = ("init_process_group", "_every_rank_set_up")


def _died_of_a_signal(exc) -> str | None:
    """Why ``exc`` is a rank (or its peer) dying of a signal, not of the body: else None."""
    if isinstance(exc, mp.ProcessExitedException):
        return f"a rank died of {exc.signal_name} (no exception)" if exc.signal_name is not None else None
    text = str(exc)
    if any(s in text for s in _SETUP) and any(p in text for p in _PEER_GONE):
        return "a peer went away while the process group was set up (gloo: connection closed by peer)"
    return None


def _run_once(body, world_size: int, args: tuple, timeout_s: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_entry, args=(body, world_size, os.path.join(tmp, "store"), args),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=5):  # raises ProcessRaisedException / ProcessExitedException
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"run_distributed: {body.__name__} ran past {timeout_s} s")
