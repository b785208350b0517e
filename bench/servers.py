"""Server processes that the benchmarks and the tests start on loopback: a free port, waiting until one
answers, stopping it."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx


class ServerLog:
    """A server's stdout and stderr in a temporary file, removed when it is closed unless `keep()` was called:
    a log that a report or an error names stays for the reader, the others do not pile up in the temp dir."""

    def __init__(self, prefix: str) -> None:
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=".log")
        self.file = os.fdopen(fd, "wb")
        self.path = Path(name)
        self._kept = False
        self._closed_text: str | None = None

    def keep(self) -> Path:
        """Keep the file after `close()`; returns its path, for the message that names it."""
        self._kept = True
        return self.path

    def text(self) -> str:
        """Everything written so far, also after `close()` removed the file."""
        if self._closed_text is not None:
            return self._closed_text
        self.file.flush()
        return self.path.read_text(errors="replace")

    def close(self) -> None:
        if self._closed_text is not None:
            return
        self._closed_text = self.text()
        self.file.close()
        if not self._kept:
            self.path.unlink(missing_ok=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_ready(process: subprocess.Popen[bytes], url: str, timeout_s: float, poll_s: float = 0.2) -> str | None:
    """Poll GET `url` until it answers 200: None then, else why not (the process exited, or the time ran out)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return f"exited with {process.returncode}"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return None
        except httpx.TransportError:
            pass
        time.sleep(poll_s)
    return f"not ready after {timeout_s} s"


def stop(process: subprocess.Popen[bytes], timeout_s: float = 20) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout_s`."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
