"""`hybridkv serve --tensor-parallel-size 2`: it answers like one process; when its worker dies,
requests get 503 and the server exits non-zero within the collective timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.server_utils import free_port
from tests.models.utils import save_model, seeded


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def spawned_worker(pid: int) -> int:
    for child in children(pid):
        cmd = Path(f"/proc/{child}/cmdline").read_bytes()
        if b"spawn_main" in cmd:
            return child
    raise AssertionError("no spawned worker")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_dead_worker_makes_the_server_answer_503_and_exit(tmp_path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    folder = save_model(seeded(LlamaForCausalLM, cfg), tmp_path / "llama")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridkv.entrypoints.cli", "serve", "--model", str(folder),
         "--port", str(port), "--tensor-parallel-size", "2", "--distributed-timeout", "5",
         "--dtype", "float32", "--memory", "64MiB"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    body = {"model": str(folder), "prompt": "t1 t2 t3", "max_tokens": 4}
    try:
        # wait for the condition itself (a loaded 2-core machine starts two ranks slowly), and
        # say so if it never comes, instead of a "connection refused" from the next request
        deadline, up = time.time() + 300, False
        while not up and time.time() < deadline and proc.poll() is None:
            try:
                up = httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.3)
        assert up, f"the server did not come up (exit code {proc.poll()})"
        ok = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert ok.status_code == 200, ok.text
        os.kill(spawned_worker(proc.pid), signal.SIGKILL)
        failed = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert failed.status_code == 503, failed.text
        assert "rank 1" in failed.json()["error"]["message"]
        code = proc.wait(timeout=120)  # it shuts down after answering
        assert code != 0
        assert "rank 1" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
