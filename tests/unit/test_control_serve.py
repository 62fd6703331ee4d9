"""A rank's command loop answers the controller for every failure of a handler, a library's
BaseException included (the controller would otherwise wait out cluster.timeout_s)."""

from __future__ import annotations

from typing import Any

import pytest

from rlbatch.runtime import control


class LibraryFailure(BaseException):
    """Like torch.distributed.checkpoint's CheckpointException: not an Exception."""


@pytest.mark.parametrize(("raised", "answered"), [(LibraryFailure("write failed"), True), (ValueError("bad"), True),
                                                  (SystemExit(0), False), (KeyboardInterrupt(), False)])
def test_a_failing_handler_is_answered_then_raised(monkeypatch: pytest.MonkeyPatch, raised: BaseException,
                                                   answered: bool) -> None:
    sent: list[Any] = []
    monkeypatch.setattr(control, "recv_obj", lambda *a, **k: ("save", {}))
    monkeypatch.setattr(control, "send_obj", lambda comm, obj, dest, tag: sent.append(obj))

    def save() -> None:
        raise raised

    with pytest.raises(type(raised)):
        control.serve(None, 0, {"save": save})
    assert [type(o) for o in sent] == ([control.RemoteError] if answered else [])
    if answered:
        assert type(raised).__name__ in sent[0].traceback


def test_a_shutdown_handler_runs_before_the_shutdown_is_acknowledged(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that serves other ranks (the env role's workers) stops that first: once the controller
    has its acknowledgement, the rank's teardown may begin."""
    events: list[str] = []
    monkeypatch.setattr(control, "recv_obj", lambda *a, **k: ("shutdown", {}))
    monkeypatch.setattr(control, "send_obj", lambda comm, obj, dest, tag: events.append("acknowledged"))
    control.serve(None, 0, {"shutdown": lambda: events.append("stopped")})
    assert events == ["stopped", "acknowledged"]
