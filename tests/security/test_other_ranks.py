"""On a multi-rank run, rank 0's clear error stays the last thing on the screen (issue 30, Tracebacks): the other
ranks, whose collectives fail because rank 0 exited, say so in one line instead of a 40-line gloo traceback."""

from __future__ import annotations

import pytest

from sapo_megatron.cli import _report_crash

GLOO = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500"


def raised(message: str) -> RuntimeError:
    try:
        raise RuntimeError(message)
    except RuntimeError as err:
        return err


@pytest.mark.parametrize(
    ("is_main", "message", "debug", "one_line"),
    [
        (False, GLOO, False, True),  # another rank after rank 0's error: one line
        (False, "NCCL error: remote process exited or there was a network error", False, True),
        (False, GLOO, True, False),  # --debug: the traceback
        (True, GLOO, False, False),  # rank 0 itself: a real failure, the traceback
        (False, "index out of range", False, False),  # a bug on another rank: the traceback
    ],
)
def test_other_ranks_stop_quietly_after_a_peer_exits(monkeypatch, capsys, is_main, message, debug, one_line):
    monkeypatch.setenv("RANK", "0" if is_main else "1")
    assert _report_crash(raised(message), is_main=is_main, debug=debug) == 1
    err = capsys.readouterr().err
    if one_line:
        assert err == "sapo-megatron: rank 1 stops: another rank ended the run (its error is above)\n"
    else:
        assert "Traceback (most recent call last)" in err and message in err
