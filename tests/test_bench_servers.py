"""The server logs that the benchmarks and the tests write: gone when closed, unless a message names them."""

from __future__ import annotations

import subprocess
import sys

from bench.servers import ServerLog


def test_a_closed_log_is_removed_and_still_readable_and_a_kept_one_stays(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    quiet, failed = ServerLog("quiet-"), ServerLog("failed-")
    for log, words in ((quiet, "ready"), (failed, "Traceback")):
        subprocess.run([sys.executable, "-c", f"print({words!r})"], stdout=log.file, stderr=subprocess.STDOUT,
                       check=True)
        assert log.text() == f"{words}\n"
    named = failed.keep()
    quiet.close()
    failed.close()
    failed.close()  # closing twice is harmless
    assert list(tmp_path.iterdir()) == [named]
    assert named.read_text() == "Traceback\n" == failed.text()
    assert quiet.text() == "ready\n"
