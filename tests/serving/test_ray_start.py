"""Starting Ray and Ray Serve on a slow or busy machine (hybridkv.serving.ray_app `init_ray`,
`run_app`), with Ray's calls replaced: no cluster starts here."""

from __future__ import annotations

import os

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
