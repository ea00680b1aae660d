"""In-process checks of zerolab.run.preempt's signal handling and zerolab.run.fault's process states
(real signals to this process; no process is started: fast tier)."""
import os
import signal

import pytest

from zerolab.run.fault import process_state
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
