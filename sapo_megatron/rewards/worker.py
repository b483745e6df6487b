"""A reward worker process: ``python -m sapo_megatron.rewards.worker``, started by :mod:`.pool`.

A fresh interpreter (not a fork of the trainer, which has torch threads) that imports the reward and no torch.
It talks to the trainer over its stdin / stdout with length-prefixed pickle frames; the reward's own prints go
to stderr. Requests: ``("init", spec, kwargs)`` then ``("task", task_id, inputs)``; replies: ``("ready",)`` or
``("init_error", message)``, and ``("done", task_id, outputs)``. The reward runs in the main thread, so
math-verify's ``signal.alarm`` timeouts work. It exits when the trainer is gone.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from sapo_megatron.rewards.framing import read_frame, write_frame

PARENT_ENV = "SAPO_REWARD_TRAINER_PID"


def _die_with_parent() -> None:
    """Exit when the trainer is gone, even in the middle of a hanging reward: a daemon thread watches the parent
    pid (``PR_SET_PDEATHSIG`` would follow the trainer *thread* that started this worker, which may end first)."""
    parent = int(os.environ.get(PARENT_ENV, os.getppid()))  # the trainer may already be gone by now

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _become_subreaper() -> None:
    """Keep what the reward forks as this worker's descendants, even a daemon that calls ``setsid`` and whose
    parent exits (Linux ``PR_SET_CHILD_SUBREAPER``): the pool then finds and kills them with the worker."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass  # not Linux: the process group is killed, a setsid daemon may outlive the run


def main() -> None:
    try:
        _serve()
    except (
        BrokenPipeError
    ):  # the trainer closed its end (it finished or stopped): nothing to answer, no traceback
        os._exit(0)  # not sys.exit: the interpreter's final flush of the closed pipe would print one


def _serve() -> None:
    _die_with_parent()
    _become_subreaper()
    reply = os.fdopen(os.dup(1), "wb")  # the protocol's channel; fd 1 becomes stderr for the reward's prints
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    requests = os.dup(0)  # and fd 0 /dev/null: a reward that reads stdin must not eat the trainer's requests
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    from sapo_megatron.rewards.calling import BoundReward

    message = read_frame(requests)
    if message is None:
        return
    _, spec, kwargs = message
    try:
        bound = BoundReward.from_spec(spec, kwargs)
    except Exception as exc:
        write_frame(reply, ("init_error", f"{type(exc).__name__}: {exc}"))
        return
    write_frame(reply, ("ready",))
    while (message := read_frame(requests)) is not None:
        _, task_id, inputs = message
        write_frame(reply, ("done", task_id, bound.run(inputs)))


if __name__ == "__main__":
    main()
