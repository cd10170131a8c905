"""Runs an unpacked OCI bundle (`umoci unpack`: rootfs/ and the runtime
config.json made from the image's config) the way a container runtime
would, without one: unshare(1) gives it its own mount, PID, network, IPC
and UTS namespaces; proc, sysfs (read-only), a /dev of the usual device
nodes, tmpfs /tmp and /dev/shm are mounted in its rootfs; a host directory
is bound read-only where a volume would be; then chroot(1) with the
config's uid and gid, env(1) from the image with the config's environment,
working directory and arguments. The process is PID 1 of its namespace, as
in a container, and its network is its own loopback: clients reach it
through nsenter(1) into that namespace, at the ports the image's config
names.

Needs root (mounts, mknod, chroot). What no runtime would skip is left out:
cgroups, seccomp, capabilities beyond those a non-root uid has anyway.
"""

import json
import os
import pathlib
import shlex
import signal
import subprocess

DEVICES = [("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9),
           ("tty", 5, 0)]


class Container:
    def __init__(self, bundle, binds, log_path):
        """binds: {path in the container: host directory}, each bound read-only."""
        config = json.loads((pathlib.Path(bundle) / "config.json").read_text())
        self.config = config
        process = config["process"]
        rootfs = pathlib.Path(bundle) / config["root"]["path"]
        lines = ["set -e", "ip link set lo up", "mount --make-rprivate /", f"R={shlex.quote(str(rootfs))}",
                 'mount -t proc -o nosuid,nodev,noexec proc "$R/proc"',
                 'mount -t sysfs -o ro,nosuid,nodev,noexec sysfs "$R/sys"',
                 'mount -t tmpfs -o nosuid,noexec,mode=755 tmpfs "$R/dev"']
        for name, major, minor in DEVICES:
            lines.append(f'mknod -m 666 "$R/dev/{name}" c {major} {minor}')
        lines += ['mkdir "$R/dev/shm" "$R/dev/pts"',
                  'mount -t tmpfs -o nosuid,nodev,noexec,mode=1777 shm "$R/dev/shm"',
                  'ln -s /proc/self/fd "$R/dev/fd"',
                  'mount -t tmpfs -o nosuid,nodev,mode=1777 tmpfs "$R/tmp"']
        for target, source in binds.items():
            t = '"$R"' + shlex.quote(target)
            lines += [f"mkdir -p {t}", f"mount --bind {shlex.quote(str(source))} {t}",
                      f"mount -o remount,bind,ro {t}"]
        user = process["user"]
        inner = ["/usr/bin/env", "-i", "-C", process.get("cwd", "/"), *process.get("env", []), *process["args"]]
        lines.append(f'exec chroot --userspec={user["uid"]}:{user["gid"]} --groups={user["gid"]} "$R" '
                     + " ".join(shlex.quote(a) for a in inner))
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            ["unshare", "--mount", "--pid", "--net", "--ipc", "--uts", "--fork", "--kill-child",
             "bash", "-c", "\n".join(lines)],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def init_pid(self):
        """The host pid of the container's PID 1 (unshare's child), or None
        before it has forked."""
        try:
            children = pathlib.Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except OSError:
            return None
        return int(children[0]) if children else None

    def exec(self, argv, timeout=60, input=None):
        """Runs a host program in the container's network namespace."""
        return subprocess.run(["nsenter", f"--target={self.proc.pid}", "--net", "--", *argv], input=input,
                              capture_output=True, timeout=timeout)

    def http(self, method, port, path, body=None, timeout=60):
        """(status, body bytes) of one HTTP request to 127.0.0.1:port inside."""
        argv = ["curl", "-sS", "-X", method, "-o", "-", "-w", "\n%{http_code}", f"http://127.0.0.1:{port}{path}"]
        if body is not None:
            argv += ["-H", "Content-Type: application/json", "--data-binary", "@-"]
        r = self.exec(argv, timeout=timeout, input=body)
        if r.returncode != 0:
            return None, r.stderr
        text, _, status = r.stdout.rpartition(b"\n")
        return int(status), text

    def stop(self, timeout=60):
        """SIGTERM to PID 1, as `docker stop` or the kubelet sends it; returns
        its exit status (None if it had to be killed) and its log."""
        pid = self.init_pid()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            code = None
        self.log.close()
        return code, pathlib.Path(self.log_path).read_text()
