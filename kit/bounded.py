"""Bounded reading of what the kit does not control (issue 42): other programs' answers (scontrol, sacctmgr and
nvidia-smi, the commands the kit runs: a byte cap, a total deadline, bytes that are not UTF-8 replaced), the files a
user names or a cache holds (a regular file of a bounded size, never a FIFO or a device, never a blocking open), the
numbers in them (ASCII digits, a bounded count of them: never Python's int-conversion limit), and other programs' text
quoted in a report (terminal escapes and control characters dropped, a length cap). One reader for each, shared by the checker,
the site's read, the reports and the first-run report. Owns: read_commands, read_regular, whole_number,
printable. Imports: the standard library only (every module may import it; the checker's path stays torch-free).
"""
from __future__ import annotations

import contextlib
import os
import re
import selectors
import signal
import stat
import subprocess
import time
from dataclasses import dataclass
from typing import BinaryIO, Iterable

# ---- numbers ----------------------------------------------------------------------------------------------------
# Every count and time Slurm keeps fits in 64 bits, and 18 decimal digits always do. A longer number is never
# converted (Python refuses int() of more than 4300 digits, and float arithmetic on a bigger one overflows): it reads
# as TOO_LARGE, above every limit the kit compares with, so the finding is the one for a number too large.
MAX_DIGITS = 18
TOO_LARGE = 10 ** MAX_DIGITS


def whole_number(text: str) -> int | None:
    """`text` as a whole number when it is ASCII digits only ('0'-'9': never '²', '٣', '1_000', ' 4', '+4', which
    Python's int() or str.isdigit() take), else None. More than MAX_DIGITS digits (leading zeros aside) read as
    TOO_LARGE, whatever their number."""
    if not text or not (text.isascii() and text.isdigit()):
        return None
    digits = text.lstrip("0")
    return int(digits or "0") if len(digits) <= MAX_DIGITS else TOO_LARGE


def quoted(text: str, width: int = 80) -> str:
    """A value as a finding quotes it: whole up to `width` characters, else its start and its length."""
    return text if len(text) <= width else f"{text[:width - 20]}...({len(text)} characters)"


def number_shown(text: str, width: int = 12) -> str:
    """A number as a finding quotes it: whole up to `width` characters, else its start and its length."""
    return text if len(text) <= width else f"{text[:6]}...({len(text)} digits)"


# ---- text quoted from other programs --------------------------------------------------------------------------------
# Terminal escapes (CSI, OSC and the two-character ones) and every other control character but tab and newline: text
# from Slurm's answers, a results file or a log is printed to a terminal, where these would move the cursor, rewrite
# what was printed, or retitle the window.
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-_]?|\x9b[0-?]*[ -/]*[@-~]"
                      r"|[\x00-\x08\x0b-\x1f\x7f-\x9f]")

LINE_CHARS = 4000  # a line of the text report: the longest finding the kit writes is under 1000 characters


def printable(text: str, limit: int = LINE_CHARS) -> str:
    """`text` without terminal escapes and control characters (tab and newline kept), cut to `limit` characters
    with the count of what was cut (escapes are looked for in the first 4 x `limit` characters only: the cost of a
    10 MB line is that of its start)."""
    clean = _ESCAPES.sub("", text[:4 * limit])
    if len(clean) <= limit and len(text) <= 4 * limit:
        return clean
    return clean[:limit] + f" ... (cut: {len(text):,} characters in all)"


def listed(names: Iterable[object], limit: int = 12, width: int = 40) -> str:
    """A few names of a list, each cut to `width` characters and made printable, and how many there are in all."""
    names = list(names)
    shown = [printable(str(n), width) for n in names[:limit]]
    return ", ".join(shown) + (f" ... ({len(names)} in all)" if len(names) > limit else "")


# ---- files -----------------------------------------------------------------------------------------------------------
class FileProblem(Exception):
    """A file that is not read: not a regular file, too large, not readable. The message names no path (the caller
    says which file, and what it is for)."""


def kind_of(mode: int) -> str:
    """What a file that is not a regular one is ('a FIFO (named pipe)', 'a character device', ...)."""
    return next((name for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                                         (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                                         (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))
                 if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike, max_bytes: int, nofollow: bool = False,
                 what: str = "such a file") -> tuple[BinaryIO, os.stat_result]:
    """An open file, if `path` is a regular file of at most `max_bytes`: checked with stat before anything opens it (a
    FIFO's open() waits for a writer, a device never ends), opened non-blocking (a FIFO swapped in between does not
    block either: O_NONBLOCK), and checked again on what was opened (fstat). `nofollow`: a symbolic link at `path`
    is refused (a cache file). Raises FileProblem, whose message says "more than `what` holds" for a large one."""
    try:
        st = os.lstat(path) if nofollow else os.stat(path)
    except OSError as exc:
        raise FileProblem(f"cannot read it ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise FileProblem(f"it is {kind_of(st.st_mode)}, not a regular file")
    if st.st_size > max_bytes:
        raise FileProblem(f"it holds {st.st_size:,} bytes, more than {what} ({max_bytes:,} bytes at most are read)")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (os.O_NOFOLLOW if nofollow else 0))
    except OSError as exc:
        raise FileProblem(f"cannot read it ({exc.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise FileProblem(f"it is {kind_of(st.st_mode)}, not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb"), st


def read_regular(path: str | os.PathLike, max_bytes: int, nofollow: bool = False, ends: bool = False,
                 what: str = "such a file") -> tuple[bytes, os.stat_result]:
    """The bytes of a regular file of at most `max_bytes` (open_regular's checks), and its stat. A file that grew
    past `max_bytes` after the check is refused too. `ends`: a bigger file is not refused but read at both ends (its
    first and last max_bytes / 2, a log's start and its last error), with a line saying what was left out."""
    f, st = open_regular(path, max_bytes if not ends else 2 ** 62, nofollow, what)
    with f:
        try:
            if ends and st.st_size > max_bytes:
                head = f.read(max_bytes // 2)
                f.seek(max(st.st_size - max_bytes // 2, len(head)))
                tail = f.read(max_bytes // 2)
                skipped = st.st_size - len(head) - len(tail)
                return head + f"\n[... {skipped:,} bytes not read ...]\n".encode() + tail, st
            data = f.read(max_bytes + (not ends))  # a log that grows while it is read (a running job's): cut
        except OSError as exc:
            raise FileProblem(f"cannot read it ({exc.strerror})") from None
    if len(data) > max_bytes:
        raise FileProblem(f"it grew past {max_bytes:,} bytes while it was read")
    return data, st


def read_fd(fd: int, max_bytes: int, deadline: float) -> tuple[bytes, str | None]:
    """What a non-blocking descriptor (a pipe) gives until its end, at most `max_bytes` + 1 bytes, until `deadline`
    (time.monotonic(); a total: a writer that trickles without end is cut as one that says nothing). Returns the
    bytes and why the reading stopped early ("deadline"), or None at the end or the cap."""
    chunks, size = [], 0
    with selectors.PollSelector() as sel:  # poll, not epoll: a regular file too (epoll refuses it, EPERM)
        sel.register(fd, selectors.EVENT_READ)
        while size <= max_bytes:
            if time.monotonic() > deadline:
                return b"".join(chunks), "deadline"
            try:  # read first: a FIFO no writer opened reads as its end at once (poll would wait)
                chunk = os.read(fd, min(1 << 16, max_bytes + 1 - size))
            except BlockingIOError:
                sel.select(max(0.0, deadline - time.monotonic()))
                continue
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    return b"".join(chunks), None


# ---- other programs' answers -----------------------------------------------------------------------------------------
MAX_ANSWER_BYTES = 4 * 2 ** 20  # scontrol show partition on a large site is tens of kB; sacctmgr's lists as much
MAX_ERROR_BYTES = 4096  # of what a command says on stderr: its first line names the problem


@dataclass
class Answer:
    """One command's answer: `text` (stdout, bytes that are not UTF-8 replaced, terminal escapes and control
    characters dropped), its exit status (None: not started, or stopped by the kit), and `why` it is not an
    answer to believe (None: a whole answer, exit status 0)."""
    argv: list[str]
    text: str
    rc: int | None
    why: str | None
    seconds: float
    error: str = ""  # the first line of stderr


def read_commands(cmds: dict[str, list[str]], seconds: float, max_bytes: int = MAX_ANSWER_BYTES,
                  empty_ok: tuple[str, ...] = ()) -> dict[str, Answer]:
    """Every command started at once, each in its own session (past the deadline the whole group goes: a wrapper's
    child would hold the pipe open), each one's stdout read until it ends, at most `max_bytes` (more: the command is
    stopped, its answer cut, not believed), within `seconds` for all of them together (a total, not an idle time).
    An empty answer with exit status 0 is not believed either, but for the commands named in `empty_ok`."""
    start = time.monotonic()
    deadline, procs, out = start + seconds, {}, {}
    for name, argv in cmds.items():
        try:
            procs[name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            out[name] = Answer(argv, "", None, f"{argv[0]} cannot be run ({exc.strerror})", 0.0)
    data, cut = _drain(procs, deadline, max_bytes)
    for name, proc in procs.items():
        rc = _ended(proc, deadline)
        raw, err = data[name]
        text = printable(raw[:max_bytes].decode("utf-8", "replace"), max_bytes)
        error = printable(err.decode("utf-8", "replace").strip().split("\n")[0], 200)
        if name in cut:
            why = f"printed more than {max_bytes >> 20} MiB" if max_bytes >= 2 ** 20 else \
                f"printed more than {max_bytes >> 10} KiB"
        elif rc is None:
            why = f"did not answer within {seconds:g} s"
        elif rc != 0:
            why = f"exit status {rc}" + (f" ({error})" if error else "")
        elif not text.strip() and name not in empty_ok:
            why = "printed nothing (exit status 0)"
        else:
            why = None
        out[name] = Answer(proc.args, text, rc, why, round(time.monotonic() - start, 3), error)
    return out


def _drain(procs: dict, deadline: float, max_bytes: int) -> tuple[dict[str, tuple[bytes, bytes]], set[str]]:
    """Read every command's stdout and stderr together (select) until each ends, passes its cap, or the deadline."""
    bufs = {name: (bytearray(), bytearray()) for name in procs}
    cut: set[str] = set()
    with selectors.DefaultSelector() as sel:
        for name, proc in procs.items():
            for k, stream in enumerate((proc.stdout, proc.stderr)):
                os.set_blocking(stream.fileno(), False)
                sel.register(stream, selectors.EVENT_READ, (name, k))
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(left):
                name, k = key.data
                try:
                    chunk = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                buf, cap = bufs[name][k], max_bytes if k == 0 else MAX_ERROR_BYTES
                buf += chunk[:cap + 1 - len(buf)]
                if not chunk or len(buf) > cap:
                    sel.unregister(key.fileobj)
                    if chunk and k == 0:  # an answer past the cap: stopped, as one past the deadline
                        cut.add(name)
                        _stop(procs[name])
    for proc in procs.values():
        for stream in (proc.stdout, proc.stderr):
            stream.close()
    return {name: (bytes(o), bytes(e)) for name, (o, e) in bufs.items()}, cut


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)


def _ended(proc: subprocess.Popen, deadline: float) -> int | None:
    """Its exit status if it ends by the deadline; else it is stopped (its whole group) and None."""
    try:
        return proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _stop(proc)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=2)
        return None
