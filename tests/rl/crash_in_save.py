"""Run ``sapo-megatron`` with a crash injected into checkpoint writing (a stand-in for SIGKILL / preemption).

``SAPO_TEST_CRASH=<checkpoint name>:<when>`` kills the process with ``os._exit`` when the checkpoint of that
name is published: ``before`` = all files written but not yet renamed into place (killed mid-save),
``after`` = right after it became the latest (killed between steps).
"""

from __future__ import annotations

import os
import sys

from sapo_megatron.checkpoint import atomic


def main() -> int:
    name, when = os.environ["SAPO_TEST_CRASH"].split(":")
    publish = atomic.publish

    def crashing_publish(tmp, final, *, replace=True):
        if final.name == name and when == "before":
            os._exit(9)
        publish(tmp, final, replace=replace)

    update_latest = atomic.update_latest

    def crashing_update_latest(final):
        update_latest(final)
        if final.name == name and when == "after":
            os._exit(9)

    atomic.publish = crashing_publish
    atomic.update_latest = crashing_update_latest
    from sapo_megatron.cli import main as cli_main

    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
