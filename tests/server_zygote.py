"""A zygote for the kill/restart tests: a process that has imported the expert servers' code once
and forks a fresh expert server per request, so that a restart costs a fork (~0.1 s) instead of a
Python start and the torch import (~2 s quiet, 10 s on a loaded 2-core machine). The children are
real expert-server processes (``expertmesh.cli`` main), killed with real signals.

Protocol (one JSON object per line on stdin): ``{"argv": [...], "log": PATH}`` -> the child's pid
on stdout. Children are reaped by the kernel (SIGCHLD ignored): their exit status is not kept.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback


def main() -> None:
    import cpu_expert_server.main  # noqa: F401 - imported once here, not in every child
    import gpu_server.main  # noqa: F401
    from expertmesh import cli

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the child: an expert server with its output in the log file
            code = 1
            try:
                fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                sys.stdout = os.fdopen(1, "w", buffering=1)
                sys.stderr = os.fdopen(2, "w", buffering=1)
                code = cli.main(req["argv"])
            except BaseException:  # noqa: BLE001 - the child's boundary: report, then exit
                traceback.print_exc()
            finally:
                os._exit(code)
        print(pid, flush=True)


if __name__ == "__main__":
    main()
