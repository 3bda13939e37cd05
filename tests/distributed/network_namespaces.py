"""Two hosts of our own: network namespaces joined by a veth pair, so a tensor-parallel engine's
ranks talk over a real (virtual) network link that a test can cut, slow or kill.

    with Hosts() as hosts:           # namespaces a and b, 10.<n>.0.1 and 10.<n>.0.2
        proc = hosts.popen("a", [...])
        hosts.link_down("b") / hosts.slow("b") / hosts.kill_all("b")

Needs root (or CAP_NET_ADMIN) and iproute2's `ip` (and `tc` for `slow`); `skip_reason()` says
why a machine cannot, so tests skip with that reason instead of failing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, check=check)


def skip_reason() -> str | None:
    """None when namespaces can be made here, else why not."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (apt-get install iproute2)"
    name = f"fgprobe{os.getpid() % 100000}"
    probe = _run("ip", "netns", "add", name, check=False)
    if probe.returncode != 0:
        return f"network namespaces are not permitted here: {probe.stderr.strip()}"
    try:
        veth = _run("ip", "link", "add", f"{name}x", "type", "veth", "peer", "name", f"{name}y", check=False)
        if veth.returncode != 0:
            return f"veth pairs cannot be made here: {veth.stderr.strip()}"
        _run("ip", "link", "del", f"{name}x", check=False)
    finally:
        _run("ip", "netns", "del", name, check=False)
    return None


class Hosts:
    def __init__(self):
        tag = os.getpid() % 100000
        self.names = {"a": f"fg{tag}a", "b": f"fg{tag}b"}
        self.links = {"a": f"fgv{tag}a", "b": f"fgv{tag}b"}
        subnet = 64 + tag % 150
        self.addresses = {"a": f"10.{subnet}.0.1", "b": f"10.{subnet}.0.2"}
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "Hosts":
        self._remove()  # leftovers of a run that was killed with this pid's names
        try:
            for ns in self.names.values():
                _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", self.links["a"], "type", "veth", "peer", "name", self.links["b"])
            for host in ("a", "b"):
                ns, link = self.names[host], self.links[host]
                _run("ip", "link", "set", link, "netns", ns)
                _run("ip", "-n", ns, "addr", "add", f"{self.addresses[host]}/24", "dev", link)
                _run("ip", "-n", ns, "link", "set", link, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self._remove()
            raise
        return self

    def _remove(self) -> None:
        for ns in self.names.values():
            if ns in _run("ip", "netns", "list", check=False).stdout:
                for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                _run("ip", "netns", "del", ns, check=False)
        _run("ip", "link", "del", self.links["a"], check=False)  # deleting one end deletes the pair

    def __exit__(self, *exc) -> None:
        self._remove()

    def popen(self, host: str, argv: list[str], env: dict | None = None, **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(["ip", "netns", "exec", self.names[host], *argv], env=env, **kwargs)
        self.procs.append(proc)
        return proc

    def pids(self, host: str) -> list[int]:
        out = _run("ip", "netns", "pids", self.names[host], check=False).stdout
        return [int(p) for p in out.split()]

    def kill_all(self, host: str) -> None:
        for pid in self.pids(host):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait_empty(self, host: str, timeout_s: float) -> list[int]:
        """Wait until no process is left in the host; the pids still there after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while self.pids(host) and time.monotonic() < deadline:
            time.sleep(0.2)
        return self.pids(host)

    def link_down(self, host: str) -> None:
        _run("ip", "-n", self.names[host], "link", "set", self.links[host], "down")

    def slow(self, host: str) -> str | None:
        """Slow the host's side of the link; returns what was applied (None: the kernel has
        neither qdisc). netem's delay and loss where the kernel has it (sch_netem), else a token
        bucket that caps the link at 128 kbit/s (each of a step's messages then waits tens of
        milliseconds, and a burst queues)."""
        ns, link = self.names[host], self.links[host]
        for qdisc in ("netem delay 40ms 10ms loss 3%", "tbf rate 128kbit burst 4kb latency 5s"):
            done = _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", link, "root", *qdisc.split(),
                        check=False)
            if done.returncode == 0:
                return qdisc
        return None
