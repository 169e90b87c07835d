"""Opening what a sandbox can write (``sandboxes/untrusted_paths.py``): no link followed, the type checked, the
size bounded, a FIFO never waited on."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from sandboxes.untrusted_paths import UntrustedPath, open_socket, read_regular, via_descriptor


def test_a_socket_is_opened_itself_and_connected_through_its_descriptor(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(path)
        listener.listen()
        fd = open_socket(path)
        try:
            assert stat.S_ISSOCK(os.fstat(fd).st_mode)
            with socket.socket(socket.AF_UNIX) as client:
                client.connect(via_descriptor(fd))
                conn, _ = listener.accept()
                conn.close()
        finally:
            os.close(fd)


def test_a_link_to_a_socket_a_fifo_or_a_file_is_not_a_socket(tmp_path: Path) -> None:
    target = str(tmp_path / "real.sock")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(target)
        os.symlink(target, tmp_path / "link")
        os.mkfifo(tmp_path / "fifo")
        (tmp_path / "file").write_text("x")
        for name, kind in (("link", "symbolic link"), ("fifo", "FIFO"), ("file", "regular file")):
            with pytest.raises(UntrustedPath, match=kind):
                open_socket(str(tmp_path / name))


def test_a_file_is_read_only_when_regular_small_and_not_a_link(tmp_path: Path) -> None:
    (tmp_path / "ok").write_bytes(b"12345")
    assert read_regular(str(tmp_path / "ok"), 5) == b"12345"
    with pytest.raises(UntrustedPath, match="more than 4"):
        read_regular(str(tmp_path / "ok"), 4)
    os.symlink(tmp_path / "ok", tmp_path / "link")
    with pytest.raises(UntrustedPath, match="symbolic link"):
        read_regular(str(tmp_path / "link"), 5)
    os.mkfifo(tmp_path / "fifo")  # no writer: a blocking open would hang here
    with pytest.raises(UntrustedPath, match="FIFO"):
        read_regular(str(tmp_path / "fifo"), 5)
    with pytest.raises(FileNotFoundError):
        read_regular(str(tmp_path / "absent"), 5)
