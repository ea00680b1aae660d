"""In-process checks of zerolab.run.preempt's signal handling and zerolab.run.fault's process states
(real signals to this process; no process is started: fast tier)."""
import os
import signal

import pytest

from zerolab.run.fault import boot_id, local_verdict, process_start, process_state
from zerolab.run.preempt import StopRequest


@pytest.fixture
def stop_request():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    StopRequest._installed, StopRequest.signal_name = False, None
    StopRequest.install()
    yield StopRequest
    for sig, handler in saved.items():  # give pytest its own handlers back
        signal.signal(sig, handler)
    StopRequest._installed, StopRequest.signal_name = False, None


def test_first_signal_is_recorded_and_agreed_alone(stop_request):
    assert not stop_request.agreed(1)
    os.kill(os.getpid(), signal.SIGUSR1)  # handled before os.kill returns to Python code
    assert stop_request.signal_name == "SIGUSR1"
    os.kill(os.getpid(), signal.SIGUSR1)  # a repeated USR1 changes nothing
    assert stop_request.signal_name == "SIGUSR1"
    assert stop_request.agreed(1)


def test_repeated_sigterm_does_not_kill(stop_request):
    """Slurm signals every process of a step and torchrun forwards its own copy: a rank gets the same
    stop twice. The second must not end the process before the checkpoint (this test's own process
    would die with it)."""
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop_request.signal_name == "SIGTERM"
    assert stop_request.agreed(1)


def test_process_state_of_self_and_of_a_gone_pid():
    assert process_state(os.getpid()) == "R"  # reading its own /proc entry: running
    assert process_state(2**22 + 1) is None  # above Linux's pid_max (2^22): no such process


def test_a_posted_process_is_recognised_by_host_boot_pid_and_start_time():
    """What the watchdog may signal: only the process that posted (this one, here), not a later
    process with its pid (another start time), nor one on a machine with the same host name
    (another boot id), nor one whose identity was not posted ("?" where /proc cannot tell)."""
    me = {"host": "node7", "pid": os.getpid(), "start": process_start(os.getpid()), "boot": boot_id()}
    assert isinstance(me["start"], int) and me["boot"] != "?"
    assert local_verdict(me, "node7") is None  # running: nothing to do
    assert local_verdict({**me, "start": me["start"] + 1}, "node7") == "exited"  # the pid is another's now
    assert local_verdict({**me, "boot": "another-boot"}, "node7") is None  # not a process this host can see
    assert local_verdict(me, "node8") is None
    assert local_verdict({**me, "start": None}, "node7") is None
    assert local_verdict({**me, "pid": 2**22 + 1}, "node7") == "exited"  # above pid_max: gone


def test_the_agreed_stop_names_the_signal_and_who_got_it(stop_request):
    from zerolab.run.preempt import Stop

    os.kill(os.getpid(), signal.SIGUSR1)
    stop = stop_request.agreed(1)
    assert stop == Stop(signal="SIGUSR1", signalled=(0,), write_failed=(), world_size=1) and stop.why() == "SIGUSR1"
    # on several ranks every one words it the same way, whichever rank got the signal
    assert Stop("SIGUSR1", (2,), (), 3).why() == "SIGUSR1 (received by rank 2)"
    assert Stop("SIGTERM", (0, 1), (), 2).why() == "SIGTERM (received by every rank)"
    assert Stop("SIGTERM", (0, 2), (), 3).why() == "SIGTERM (received by ranks 0, 2)"


def test_a_write_that_did_not_fit_is_agreed_as_a_stop(stop_request):
    assert stop_request.agreed(1) is None
    stop_request.write_failed("/x/metrics.jsonl", "the record of step 3 did not fit")
    stop_request.write_failed("/x/summary.json", "a later one")  # the first is what is said
    stop = stop_request.agreed(1)
    assert stop.write_failed == (0,) and stop.signal is None
    assert stop_request.write_failure == ("/x/metrics.jsonl", "the record of step 3 did not fit")
    stop_request.install()  # a new run in this process starts with none
    assert stop_request.write_failure is None and stop_request.agreed(1) is None
