"""rlbatch.osinfo: mounts, nearest existing ancestors and command lines, read from /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from rlbatch.osinfo import mount_of, nearest_existing, process_cmdline


def test_the_mount_of_a_path_is_the_deepest_mount_point_above_it(tmp_path: Path) -> None:
    proc = mount_of(Path("/proc/self/status"))
    assert proc is not None and proc.point == Path("/proc") and proc.fstype == "proc"
    here = mount_of(tmp_path)
    root = mount_of(Path("/"))
    assert here is not None and root is not None and root.point == Path("/")
    assert here.point == tmp_path or here.point in tmp_path.parents
    assert os.stat(here.point).st_dev == os.stat(tmp_path).st_dev  # the mount that really holds it


def test_nearest_existing_ancestor_follows_links_as_mkdir_does(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert nearest_existing(tmp_path / "link" / "a" / "b") == (tmp_path / "real").resolve()
    assert nearest_existing(tmp_path / "real") == (tmp_path / "real").resolve()


def test_a_command_line_is_read_while_the_process_lives_and_none_after() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "marker-arg"])
    try:
        deadline = time.monotonic() + 30  # until the child has exec'd Python (empty before)
        while not (line := process_cmdline(child.pid)) or "marker-arg" not in line:
            assert time.monotonic() < deadline, line
            time.sleep(0.05)
        assert line is not None and "marker-arg" in line and "time.sleep(30)" in line
    finally:
        child.kill()
        child.wait()
    assert process_cmdline(child.pid) is None
    assert process_cmdline("not a pid") is None  # type: ignore[arg-type]
