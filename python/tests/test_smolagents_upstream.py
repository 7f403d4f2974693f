"""smolagents' own remote-executor integration suite (`CommonDockerExecutorIntegration` in
its tests/test_remote_executors.py, from the source release scripts/fetch-python-env.sh
fetched), run unchanged against TandemExecutor on Docker: state across steps, text and
picture final answers, the final-answer patterns, custom final-answer tools, syntax errors."""
from __future__ import annotations

import os
import pathlib
import sys
import types

import pytest
from smolagents.monitoring import AgentLogger, LogLevel

from tandem_client.smolagents import TandemExecutor

from conftest import Daemon, docker_image

VENV = pathlib.Path(sys.prefix)
SOURCE = VENV / "upstream" / "smolagents-1.26.0"
if not (SOURCE / "tests" / "test_remote_executors.py").exists():
    pytest.fail(f"smolagents' source release is not at {SOURCE}: run scripts/fetch-python-env.sh", pytrace=False)

# The suite imports a marker from a helper its source release leaves out; it only gates on
# an environment variable, which this run means to pass.
markers = types.ModuleType("tests.utils.markers")
markers.require_run_all = lambda f: f  # type: ignore[attr-defined]
sys.modules.setdefault("tests.utils", types.ModuleType("tests.utils"))
sys.modules["tests.utils.markers"] = markers
sys.path.insert(0, str(SOURCE))
os.environ.setdefault("RUN_ALL", "1")
from tests.test_remote_executors import CommonDockerExecutorIntegration  # noqa: E402

class TestTandemExecutorUpstream(CommonDockerExecutorIntegration):
    @pytest.fixture
    def custom_executor(self, daemon: Daemon):
        docker_image()
        ex = TandemExecutor(["numpy", "PIL"], AgentLogger(level=LogLevel.OFF), executor="docker", host=daemon.host)
        yield ex
        ex.cleanup()
