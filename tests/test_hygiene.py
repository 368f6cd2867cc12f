"""The suite's own rules, on small suites run with this conftest: every test that uses a
cluster is marked ``cluster`` without being told, and a test or cluster fixture that leaks
fails, naming what it leaked."""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq

import pwmesh as pw
from helpers import check_no_leaks, eventually, held

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def suite(pytester: pytest.Pytester) -> Callable[[str], pytest.RunResult]:
    """Runs pytest (``suite(test_file_text, *args)``) on one test file beside this suite's
    conftest and helpers, with this project's configuration."""
    (pytester.path / "tests").mkdir()
    for name in ("conftest.py", "helpers.py"):
        shutil.copy(TESTS / name, pytester.path / "tests" / name)
    shutil.copy(TESTS.parent / "pyproject.toml", pytester.path / "pyproject.toml")

    def run(text: str, *args: str) -> pytest.RunResult:
        (pytester.path / "tests" / "test_it.py").write_text(textwrap.dedent(text))
        return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "0", *args)  # in one process

    return run


# Every way a test comes to use a cluster; none of them is ever set up (collection only).
USES = '''
    import pytest
    import pwmesh as pw

    SHAPE = pw.LocalClusterSpec(islands=1)


    def _start():
        return pw.LocalCluster(SHAPE)


    @pytest.fixture(scope="module")
    def on_wide(wide_cluster):
        return wide_cluster


    @pytest.fixture
    def own():
        yield _start()


    def test_plain():
        pass


    def test_client(client):
        pass


    def test_default_client(default_client):
        pass


    def test_objects(objects):
        pass


    def test_a_fixture_that_depends_on_one(on_wide):
        pass


    def test_a_fixture_that_starts_one_through_a_function(own):
        pass


    @pytest.mark.parametrize("n", [1, 2])
    def test_own_code_starts_one(n):
        with pw.LocalCluster(SHAPE):
            pass


    def test_an_embedded_one_of_a_given_shape():
        pw.connect(cluster=SHAPE)
'''


def test_not_cluster_selects_no_test_that_uses_a_cluster(suite: Callable[..., pytest.RunResult]) -> None:
    result = suite(USES, "--collect-only", "-q", "-m", "not cluster")
    selected = [line for line in result.outlines if "::" in line]
    assert selected == ["tests/test_it.py::test_plain"], result.stdout.str()
    assert "1/9 tests collected (8 deselected)" in result.stdout.str(), result.stdout.str()


LEAKS = '''
    import os
    import subprocess
    import sys
    import threading
    from pathlib import Path

    import pytest
    import zmq

    import helpers

    helpers.LEAK_GRACE_SECONDS = 0.5  # nothing here would be given back later: fail soon
    STOP = threading.Event()
    KEPT = []  # what the leaking test leaves referenced (a leak, not garbage)


    @pytest.fixture(scope="module")
    def cluster():  # stands in for the real one (never started here): takes a thread, never gives it back
        threading.Thread(target=STOP.wait, name="left-by-the-fixture", daemon=True).start()
        yield "tcp://127.0.0.1:1"


    @pytest.fixture
    def client(cluster):
        yield cluster


    def test_leaks_one_of_each(client):
        threading.Thread(target=STOP.wait, name="left-running", daemon=True).start()
        ctx = zmq.Context()
        read, write = os.pipe()
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        Path("child.pid").write_text(str(child.pid))
        KEPT.append((ctx, read, write, child))


    def test_gives_everything_back(client):
        worker = threading.Thread(target=lambda: None, name="joined")
        worker.start()
        worker.join()
        with zmq.Context() as ctx, ctx.socket(zmq.DEALER):
            pass
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        with open(os.devnull) as closed:
            closed.read()


    def test_a_test_without_a_cluster_is_not_checked():
        threading.Thread(target=STOP.wait, name="unchecked", daemon=True).start()
'''


def test_a_leak_fails_its_test_naming_what_leaked(suite: Callable[..., pytest.RunResult],
                                                  pytester: pytest.Pytester) -> None:
    result = suite(LEAKS)
    out = result.stdout.str()
    result.assert_outcomes(passed=3, errors=2)
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_leaks_one_of_each*",
        "*test_it.py::test_leaks_one_of_each leaked (still held 0.5 seconds later):",
        "*thread 'left-running' (daemon)*",
        "*child process *import time; time.sleep(120)",
        "*file descriptor * -> pipe:*",
        "*file descriptor * -> pipe:*",
        "*ZeroMQ context #* made at test_it.py:* (test_leaks_one_of_each)*",
        "*ERROR at teardown of test_a_test_without_a_cluster_is_not_checked*",
        "*the module-scoped fixture 'cluster', torn down, leaked*",
        "*thread 'left-by-the-fixture' (daemon)*",
    ])
    assert "'unchecked'" not in out and "'joined'" not in out, out
    # The leaked child was killed: it does not run on through later tests.
    pid = int((pytester.path / "child.pid").read_text())
    eventually(lambda: not running(pid), 30)


def running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"  # exited, and not (yet) reaped


def test_a_client_refused_at_once_leaves_nothing_behind() -> None:
    """An address ZeroMQ refuses fails the client before any I/O thread starts; its context
    and socket are closed then, not left to the collector (which would warn)."""
    before = held()
    with pytest.raises(zmq.ZMQError):
        pw.Client("not-an-address")
    check_no_leaks(before, what="a client given an address ZeroMQ refuses", timeout_seconds=5.0)
