"""A long wait polls tens of times a second, not a thousand: a rank waiting for its next command
and the controller waiting for a phase back off in proportion to the time already waited
(``rlbatch.runtime.control.Patience``), and still notice a message and a deadline promptly.
Counted on a simulated clock (polls and sleeps), not timed."""

from __future__ import annotations

import pytest

from rlbatch.runtime import control
from rlbatch.runtime.control import CONTROLLER, IDLE, PROMPT, ControlTimeout, Patience, wait_until


class Clock:
    """time.perf_counter and time.sleep of a simulated clock: sleeping advances it, nothing else does."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(control.time, "perf_counter", c.perf_counter)
    monkeypatch.setattr(control.time, "sleep", c.sleep)
    monkeypatch.setattr(control.os, "sched_yield", lambda: c.sleep(1e-5))
    return c


def wait_for(clock: Clock, arrives_s: float, patience: Patience) -> tuple[int, float]:
    """Polls of a wait for a message that arrives ``arrives_s`` into it, and how late it was seen."""
    start = clock.now
    polls = wait_until(lambda: clock.now - start >= arrives_s, float("inf"), lambda: "x", patience)
    return polls, clock.now - start - arrives_s


def test_an_idle_wait_polls_a_few_dozen_times_a_second_and_notices_within_its_bound(clock: Clock) -> None:
    prompt, _ = wait_for(clock, 30.0, PROMPT)
    idle, late = wait_for(clock, 30.0, IDLE)
    ctl, ctl_late = wait_for(clock, 30.0, CONTROLLER)
    assert prompt > 29_000  # one poll a millisecond, as before
    assert idle < 2_000 and idle * 15 < prompt  # ~50 a second once idle, ~1.9k in 30 s
    assert late <= IDLE.cap_s + 1e-9
    assert ctl < 7_000 and late >= ctl_late  # the controller's bound is tighter: it is on the critical path
    assert ctl_late <= CONTROLLER.cap_s + 1e-9
    # a short wait is as prompt as before: a reply within the first 0.1 s is seen within 1 ms
    for arrives in (0.0005, 0.01, 0.09):
        assert wait_for(clock, arrives, IDLE)[1] <= control.MAX_PAUSE_S + 1e-9
    # proportional in between: 1 s idle, noticed within 1% of it
    assert wait_for(clock, 1.0, IDLE)[1] <= 0.01 * 1.0 + 1e-9


def test_a_backed_off_wait_still_times_out_at_its_deadline(clock: Clock) -> None:
    start = clock.now
    with pytest.raises(ControlTimeout, match="timed out after 60s waiting for the phase"):
        wait_until(lambda: False, 60.0, lambda: "the phase", IDLE)
    assert 60.0 <= clock.now - start <= 60.0 + 2e-3
