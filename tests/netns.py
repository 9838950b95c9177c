"""Two machines on one, for the tests that cut a node off the network: two network namespaces
joined by a veth pair (addresses that exist only inside them), each node run in its own PID
namespace too, so that neither side can see, signal or wait for the other's processes.

Nothing is named system-wide: a namespace lives as long as a process in it, and every one
of those is bounded: the holder sleeps at most :data:`LIFETIME_S`, a node's command is killed
after as long (``timeout``, the first process of its PID namespace: when it goes, the kernel
ends the rest). Leaving the context kills every process found in the two network namespaces,
and waits for them. Needs root and util-linux/coreutils/iproute2 (``unshare``, ``nsenter``,
``timeout``, ``ip``); :func:`unavailable` says why a machine cannot.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

ADDRESSES = ("10.213.0.1", "10.213.0.2")  # node 0, node 1: inside the namespaces only
INTERFACES = ("n0", "n1")  # the ends of the veth pair (names private to each namespace)
LIFETIME_S = 300  # nothing started here outlives this, whatever happens to the test
TOOLS = ("unshare", "nsenter", "timeout", "ip")


def _quiet(*argv, timeout: float = 10) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def unavailable() -> str | None:
    """Why two namespaced nodes cannot be made here; None when they can."""
    if os.geteuid() != 0:
        return "network and PID namespaces need root (CI runs as root)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed (util-linux, coreutils, iproute2)"
    probe = _quiet("unshare", "--net", "--pid", "--fork", "--mount-proc", "ip", "link",
                   "set", "lo", "up")
    if probe.returncode != 0:
        return f"this sandbox refuses new namespaces: {probe.stderr.strip()[:200]}"
    return None


class TwoNodes:
    """``with TwoNodes() as nodes``: two linked namespaces; :meth:`start` runs a command on a
    node (in a PID namespace of its own), :meth:`cut` takes a node off the link. On leaving,
    every process started here is killed and waited for, then the namespaces go with them."""

    def __init__(self):
        self.holders: list[subprocess.Popen] = []
        self.started: list[subprocess.Popen] = []
        self.namespaces: list[str] = []  # their /proc/PID/ns/net links: what to clean up

    def __enter__(self):
        try:
            self._link()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _link(self):
        ours = os.readlink("/proc/self/ns/net")
        for _ in ADDRESSES:
            holder = subprocess.Popen(["unshare", "--net", "sleep", str(LIFETIME_S)])
            self.holders.append(holder)
            deadline = time.monotonic() + 10
            while os.readlink(f"/proc/{holder.pid}/ns/net") == ours:
                if holder.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the namespace holder did not start")
                time.sleep(0.01)
            self.namespaces.append(os.readlink(f"/proc/{holder.pid}/ns/net"))
        self._in(0, "ip", "link", "add", INTERFACES[0], "type", "veth", "peer", "name",
                 INTERFACES[1], "netns", str(self.holders[1].pid))
        for node, (address, interface) in enumerate(zip(ADDRESSES, INTERFACES)):
            self._in(node, "ip", "address", "add", f"{address}/24", "dev", interface)
            self._in(node, "ip", "link", "set", interface, "up")
            self._in(node, "ip", "link", "set", "lo", "up")

    def _enter(self, node: int) -> list[str]:
        return ["nsenter", f"--net=/proc/{self.holders[node].pid}/ns/net"]

    def _in(self, node: int, *argv: str):
        done = _quiet(*self._enter(node), *argv)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} on node {node}: {done.stderr.strip()}")

    def start(self, node: int, argv: list[str], **popen) -> subprocess.Popen:
        """``argv`` on ``node``, in a PID namespace of its own (killing the process returned
        kills everything in it)."""
        process = subprocess.Popen([*self._enter(node), "unshare", "--pid", "--fork",
                                    "--kill-child", "--mount-proc", "timeout", "--signal=KILL",
                                    str(LIFETIME_S), *argv], **popen)
        self.started.append(process)
        return process

    def cut(self, node: int):
        """Take ``node``'s end of the link down: from now on nothing passes either way, and
        nothing tells either side (no reset, no error): a cable pulled, a switch gone."""
        self._in(node, "ip", "link", "set", INTERFACES[node], "down")

    def _inside(self) -> list[int]:
        """The processes in our network namespaces now."""
        found = []
        for entry in os.listdir("/proc"):
            try:
                if entry.isdigit() and os.readlink(f"/proc/{entry}/ns/net") in self.namespaces:
                    found.append(int(entry))
            except OSError:
                continue  # gone meanwhile
        return found

    def __exit__(self, *exc):
        for process in [*self.started, *self.holders]:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
        for process in [*self.started, *self.holders]:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        # A node whose unshare was killed before it could tie its child's life to its own
        # (the child then outlives it): anything still in our namespaces goes too.
        deadline = time.monotonic() + 30
        while (inside := self._inside()) and time.monotonic() < deadline:
            for pid in inside:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
