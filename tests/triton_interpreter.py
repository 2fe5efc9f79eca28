"""Triton kernels on a CPU, through Triton's interpreter: a child process, since TRITON_INTERPRET must be set
before Triton is first imported."""

from __future__ import annotations

import os
import subprocess
import sys


def run_interpreted(code: str, timeout: int = 600) -> None:
    """Run `code` (a program that prints "ok" last) in a child under Triton's interpreter; assert it did."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
