"""Process-memory readings the tests share (Linux: /proc)."""

from __future__ import annotations


def rss_bytes() -> int:
    """This process's resident memory."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")
