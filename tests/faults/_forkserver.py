"""A warm process for the crash campaign: it imports moet_cache once, then forks one child per request.

Protocol (one JSON document per line): it prints {"ready": true}; for each request {"argv": [...]}
(optionally "env": {...}, set in the child only) on stdin it forks a child that runs moet_cache.cli.app.main(argv), prints {"pid": N}, waits for the
child and prints {"rc": exit code or null, "signal": signal number or null}. The campaign SIGKILLs
the child by pid. The server itself never runs torch code, so forking it is safe.
"""

from __future__ import annotations

import json
import os
import sys

from moet_cache.cli.app import main


def warm(argv: list[str]) -> None:
    """Run one command here first, so that every lazy import and first-use cost is paid before forking."""
    import torch
    torch.set_num_threads(1)  # no intra-op thread pool: forking a process with idle pool threads is unsafe
    saved = os.dup(1), os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    try:
        main(argv)
    finally:
        sys.stdout.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)


def serve() -> None:
    if len(sys.argv) > 1:
        warm(json.loads(sys.argv[1]))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        argv = req["argv"]
        pid = os.fork()
        if pid == 0:  # the child: quiet, and exits without running the parent's cleanup
            os.environ.update(req.get("env") or {})  # e.g. MOET_CACHE_TEST_KILL_AT (moet_cache.cache.commit)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            rc = 70
            try:
                rc = main(argv)
            finally:
                os._exit(rc if isinstance(rc, int) else 70)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                          "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None}), flush=True)


if __name__ == "__main__":
    serve()
