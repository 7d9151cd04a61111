import subprocess
import sys
import textwrap

import pytest

# Allocates and fills a ~40 MB tensor 50 times (with a small allocation in between, as real code
# has) and prints the minor page faults: with mmap'd blocks every round faults in each of its
# 4 KiB pages again (about 10k faults a round); with freed blocks kept, rounds reuse memory.
PROBE = textwrap.dedent(
    """
    import random, resource, sys
    import torch
    from hybridkv.worker import host_memory
    if sys.argv[1] == "tuned":
        assert host_memory.keep_freed_memory()
        assert host_memory.keep_freed_memory()  # idempotent
    random.seed(0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(50):
        t = torch.empty((10 << 20) + random.randint(0, 1000), dtype=torch.float32)
        t.fill_(1.0)
        small = torch.empty(random.randint(1, 5000))
        del t
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")
def test_keep_freed_memory_stops_page_faults_on_reused_blocks():
    default = faults("default")
    assert default > 40 * 10240  # nearly every round faults in all its pages
    assert faults("tuned") < default / 5
