"""Starting and stopping a server with all its children: shared by the Python tests and
bench/python/gunicorn_gpu.py."""
import os
import signal
import subprocess
import time


def start(cmd, cwd, env, log_path):
    """Starts `cmd` in a new session (its own process group), output to log_path."""
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def stop(proc, timeout=20):
    """SIGTERM to the server, wait for it and its process group; SIGKILL what is left.

    Returns the server's exit status (None if it had to be killed)."""
    pgid = proc.pid  # start_new_session: the group id is the leader's pid
    rc = None
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + timeout
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if group_alive(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)
        rc = None
    return rc
