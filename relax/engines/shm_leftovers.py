"""What a server process group leaves in ``/dev/shm``, found while it runs and removed once it is gone.

SGLang's processes and the Intel OpenMP they preload create POSIX shared memory and remove it only on a clean
Python exit, which a killed scheduler never has: measured on 0.5.23 (CPU) after every stop, graceful or not,
``__KMP_REGISTERED_LIB_<pid>_*`` (libiomp5, one per process), ``sglang_loads_*.shm`` (the load snapshot) and,
on AMX machines, ``deepspeed_allreduce_buffer_0_<host>_<nccl port>_0`` (258 MB). An elastic pool that cycles
engines would fill the node's RAM with them.

Which files are a server's is read from the kernel, not guessed from names: the ``/dev/shm`` files its
processes have open or mapped, the OpenMP registrations named by their pids, and names carrying a tag the
launcher chose (the server's own NCCL port). The sweep runs after the whole process group is gone.

A file is recognised by its inode as well as its name. glibc's ``sem_open`` (Python's multiprocessing locks,
which SGLang's processes make) creates a temporary ``sem.XXXXXX``, maps it, hard-links it to its real name
``sem.mp-…`` and unlinks the temporary one: ``/proc/<pid>/maps`` then names a file that no longer exists, and
only the inode leads to the live name, which a SIGKILLed group leaves behind.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

SHM_DIR = Path("/dev/shm")
#: Intel OpenMP's registration file of process ``pid``: ``__KMP_REGISTERED_LIB_<pid>_<n>``.
KMP_PREFIX = "__KMP_REGISTERED_LIB_"


def group_pids(pgid: int, proc: Path = Path("/proc")) -> set[int]:
    """Every live process in process group ``pgid`` (zombies are not: they hold no memory any more).

    Read with raw ``os`` calls: a guard scans every process of the node every few seconds for as long as its
    server runs, and ``Path.read_text`` made that scan 3.7x dearer (4.6 ms against 1.2 ms per scan, measured).
    """
    pids: set[int] = set()
    want = str(pgid).encode()
    try:
        names = os.listdir(proc)
    except OSError:
        return pids
    for name in names:
        if not name.isdigit():
            continue
        try:
            fd = os.open(f"{proc}/{name}/stat", os.O_RDONLY)
            try:
                stat = os.read(fd, 512)  # pid (comm) state ppid pgrp ...: comm is at most 16 bytes
            finally:
                os.close(fd)
        except OSError:
            continue
        # comm may hold spaces and parentheses, so split after the last ')'
        fields = stat.rsplit(b")", 1)[-1].split()
        if len(fields) > 2 and fields[2] == want and fields[0] not in (b"Z", b"X"):
            pids.add(int(name))
    return pids


def shm_held_by(pids: Iterable[int], proc: Path = Path("/proc"), shm: Path = SHM_DIR) -> set[str]:
    """Names of the ``/dev/shm`` files that processes ``pids`` have open or mapped: by the name they were opened
    with, and by inode (the live name of a file whose opening name was unlinked, as ``sem_open`` does)."""
    names: set[str] = set()
    inodes: set[int] = set()
    prefix = str(shm) + "/"
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in (proc / str(pid) / "maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                path = fields[-1] if len(fields) == 6 else ""
                if path.startswith(prefix):
                    names.add(path[len(prefix):].removesuffix(" (deleted)"))
                    if fields[4].isdigit():
                        inodes.add(int(fields[4]))
        with contextlib.suppress(OSError):
            for fd in (proc / str(pid) / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith(prefix):
                        names.add(target[len(prefix):].removesuffix(" (deleted)"))
                        inodes.add(os.stat(fd).st_ino)
    if inodes:  # read now, while the group runs: an inode can only be reused once its last name is gone
        for entry in shm.iterdir() if shm.is_dir() else ():
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_ino in inodes:
                    names.add(entry.name)
    return names


@dataclass
class ShmLedger:
    """The ``/dev/shm`` names one server made: noted while it runs, removed by :meth:`sweep` after it is gone."""

    tags: tuple[str, ...] = ()
    pids: set[int] = field(default_factory=set)
    names: set[str] = field(default_factory=set)

    def note(self, pgid: int, proc: Path = Path("/proc"), shm: Path = SHM_DIR) -> None:
        """Record the group's processes and what they hold now (call while it runs; cheap: a /proc scan)."""
        pids = group_pids(pgid, proc)
        self.pids |= pids
        self.names |= shm_held_by(pids, proc, shm)

    def owned(self, shm: Path = SHM_DIR) -> list[Path]:
        """The files in ``shm`` that are this server's."""
        out = []
        for entry in shm.iterdir() if shm.is_dir() else ():
            name = entry.name
            mine = name in self.names or any(tag in name for tag in self.tags)
            if name.startswith(KMP_PREFIX):
                pid = name[len(KMP_PREFIX):].split("_", 1)[0]
                mine = mine or (pid.isdigit() and int(pid) in self.pids)
            if mine:
                out.append(entry)
        return out

    def sweep(self, shm: Path = SHM_DIR) -> list[str]:
        """Remove this server's files (call once its process group is gone); returns the names removed."""
        removed = []
        for path in self.owned(shm):
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path.name)
        return removed


__all__ = ["ShmLedger", "group_pids", "shm_held_by"]
