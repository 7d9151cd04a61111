"""Starting Ray and Ray Serve on a slow or busy machine (hybridkv.serving.ray_app `init_ray`,
`run_app`), with Ray's calls replaced: no cluster starts here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")

from hybridkv.serving import ray_app  # noqa: E402


def test_a_local_cluster_gets_room_for_the_proxy_and_the_user_wins(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr("ray.init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.delenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", raising=False)
    monkeypatch.setenv("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "7")
    ray_app.init_ray(num_cpus=2)
    assert os.environ["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "60"
    assert os.environ["RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"] == "7"  # set by the user
    assert calls == [
        {"address": None, "include_dashboard": False, "log_to_driver": False, "num_cpus": 2}
    ]
    # joining a cluster by address: its processes run already, nothing is set
    monkeypatch.delenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S")
    ray_app.init_ray("ray://head:10001")
    assert "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S" not in os.environ
    assert calls[-1]["address"] == "ray://head:10001"


def test_run_app_waits_past_ray_serves_fixed_timeouts(monkeypatch) -> None:
    """Each of serve.start and serve.run is called again after Ray Serve's 60 s TimeoutError
    until it returns; past the deadline the error is raised."""
    calls: list[str] = []
    failures = {"start": 2, "run": 1}

    def call(name: str):
        def f(*args, **kwargs):
            calls.append(name)
            if failures[name] > 0:
                failures[name] -= 1
                raise TimeoutError(f"HTTP proxies not available after 60s ({name})")

        return f

    monkeypatch.setattr(ray_app.serve, "start", call("start"))
    monkeypatch.setattr(ray_app.serve, "run", call("run"))
    ray_app.run_app(object(), {"port": 1})
    assert calls == ["start", "start", "start", "run", "run"]

    failures["start"] = 1
    with pytest.raises(TimeoutError, match="start"):
        ray_app.run_app(object(), {"port": 1}, deadline_s=0.0)


def test_the_cluster_module_runs_first_so_no_worker_splits_it(request) -> None:
    """tests/conftest.py RUN_FIRST: the Ray Serve module's tests lead the collection (where it
    is collected), so xdist's worksteal keeps them on one worker and one cluster."""
    names = [Path(str(item.fspath)).name for item in request.session.items]
    ray_tests = [k for k, name in enumerate(names) if name == "test_ray_serve.py"]
    assert ray_tests == list(range(len(ray_tests)))
