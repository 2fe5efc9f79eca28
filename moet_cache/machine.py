"""What this process may use of the machine it runs on."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on: taskset and cgroup cpusets narrow it below os.cpu_count()."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no sched_getaffinity on this platform
        return os.cpu_count() or 1
