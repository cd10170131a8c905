"""Fixtures of the serve tests; the helpers they share are in serve_support.py."""
import pytest

from serve_support import CLI, DEVICE, start_serve, stop_serve


def pytest_report_header(config):
    return f"hearth: {CLI}, models on {DEVICE}"


@pytest.fixture
def serve(tmp_path):
    """Starts `hearth serve` on a repository (start_serve's arguments; its log
    in tmp_path) and returns its state. Each server the test has not stopped
    itself is stopped at the end with SIGTERM and must exit 0: a test need
    not stop its servers, and a failing one leaves none behind."""
    started = []

    def start(repo, extra_args=(), **kwargs):
        state = start_serve(tmp_path, repo, extra_args, **kwargs)
        started.append(state)
        return state

    yield start
    unclean = []
    for state in started:
        if state["log_file"].closed:
            continue  # stopped by the test
        code, text = stop_serve(state)
        if code != 0:
            unclean.append(f"{state['log']}: exit {code}\n{text[-3000:]}")
    assert not unclean, "\n\n".join(unclean)
