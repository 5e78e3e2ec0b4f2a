"""Runs an untrusted Python program in a throwaway, locked-down process.

The parent (the trainer's event loop) spawns this file as a launcher script with
`asyncio.create_subprocess_exec`, in a new session. The launcher sets up the isolation,
forks the program's process and relays its exit status. Layers, each detected once by
`probe()` and then required on every run (a run whose set-up falls short fails):

- network: a new network namespace (as root directly, otherwise inside a new user
  namespace): no interface is up, so nothing can be reached, 127.0.0.1 included.
  Independently a seccomp filter makes socket() fail for every family but AF_UNIX and
  forbids io_uring, and Landlock (ABI >= 4) denies TCP bind/connect. Either of the
  last two alone blocks new sockets to the network if namespaces are refused.
- processes: a new PID namespace whose init is the program, with PDEATHSIG tied to the
  launcher: when either dies the kernel kills everything in the namespace. The parent
  also kills the process group and, where the program ran under its own uid, every
  process of that uid, so an escape with setsid() does not outlive the run.
- RLIMIT_NPROC caps forks. Root is exempt from it, so as root the launcher drops to an
  unprivileged uid of its own per concurrent slot (`uid_base + slot`); that uid owns
  only the sandbox directory. Non-root in a user namespace the limit counts that
  namespace only; non-root without one it is the uid's current task count plus the cap.
- files: Landlock (any ABI) allows writes only below the sandbox directory and to
  /dev/null; reads stay allowed (the interpreter needs its library). Landlock ABI >= 6
  also forbids signalling processes outside the sandbox. The directory is the
  program's cwd, HOME and TMPDIR, and is removed after the run.
- rlimits on CPU time, address space, file size, open files; no core dumps.

This module is run as a script by an isolated interpreter (`python -I -S`), so it
imports only the standard library.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import math
import os
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NoReturn

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_CLONE_NEWPID = 0x20000000
_PR_SET_PDEATHSIG = 1
_PR_SET_SECCOMP = 22
_PR_SET_NO_NEW_PRIVS = 38
_SYS_LANDLOCK_CREATE, _SYS_LANDLOCK_ADD_RULE, _SYS_LANDLOCK_RESTRICT = 444, 445, 446
_SETUP_FAILED = 125  # launcher exit status: a required layer could not be set up
# audit arch, socket(), io_uring_setup() per machine; other machines get no seccomp layer
_SECCOMP_ARCH = {"x86_64": (0xC000003E, 41, 425), "aarch64": (0xC00000B7, 198, 425)}


class SandboxUnavailable(RuntimeError):
    """This machine cannot provide the isolation a sandboxed run needs."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What one program may use; the config's `reward.sandbox` section says what each
    field means (`rpk.config.SandboxConfig`), and `rpk.assembly.settings` copies them."""

    memory_mb: int = 1024
    max_processes: int = 32
    max_output_kb: int = 4096
    max_file_mb: int = 16
    max_open_files: int = 64


@dataclass(frozen=True, slots=True)
class Isolation:
    """Which layers took effect in the probe run."""

    user_namespace: bool
    net_namespace: bool
    pid_namespace: bool
    uid_drop: bool
    landlock_abi: int  # 0 = unavailable
    seccomp: bool
    python: str  # the interpreter that runs programs

    @property
    def network_blocked(self) -> bool:
        return self.net_namespace or self.seccomp or self.landlock_abi >= 4

    def required(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "python"}


@dataclass(frozen=True, slots=True)
class ProgramRun:
    status: str  # "exited" | "timeout" | "output_limit"
    returncode: int | None
    stdout: bytes
    stderr: bytes
    wall_s: float
    pgid: int  # the launcher's session and group, for checks that it is gone

    @property
    def ok(self) -> bool:
        return self.status == "exited" and self.returncode == 0


# --- the launcher: runs in its own interpreter, never in the trainer ---------------------


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _unshare(libc: ctypes.CDLL, flags: int) -> bool:
    return libc.unshare(flags) == 0


def _enter_user_namespace(libc: ctypes.CDLL) -> bool:
    uid, gid = os.geteuid(), os.getegid()
    if not _unshare(libc, _CLONE_NEWUSER):
        return False
    maps = (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1"))
    for name, text in maps:
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    return True


def _landlock(libc: ctypes.CDLL, workdir: str) -> int:
    """Allow writes only below workdir and to /dev/null; returns the ABI, 0 if none."""
    abi = libc.syscall(_SYS_LANDLOCK_CREATE, None, 0, 1)
    if abi <= 0:
        return 0
    write_file = 1 << 1
    fs = sum(1 << b for b in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))  # every write-type right of ABI 1
    file_rights = write_file
    for bit, since in ((13, 2), (14, 3), (15, 5)):  # REFER, TRUNCATE, IOCTL_DEV
        if abi >= since:
            fs |= 1 << bit
            file_rights |= (1 << bit) if bit != 13 else 0
    net = 0b11 if abi >= 4 else 0  # BIND_TCP | CONNECT_TCP, with no rule allowing any port
    scoped = 0b11 if abi >= 6 else 0  # abstract unix sockets and signals
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    attr = struct.pack("QQQ", fs, net, scoped)[:size]
    ruleset = libc.syscall(_SYS_LANDLOCK_CREATE, attr, size, 0)
    if ruleset < 0:
        return 0
    for path, rights in ((workdir, fs), ("/dev/null", file_rights)):
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = struct.pack("=Qi", rights, fd)
        if libc.syscall(_SYS_LANDLOCK_ADD_RULE, ruleset, 1, rule, 0) != 0:
            return 0
        os.close(fd)
    if libc.syscall(_SYS_LANDLOCK_RESTRICT, ruleset, 0) != 0:
        return 0
    os.close(ruleset)
    return abi


def _seccomp(libc: ctypes.CDLL) -> bool:
    """socket() other than AF_UNIX and io_uring fail with EACCES; foreign ABIs are killed."""
    arch = _SECCOMP_ARCH.get(os.uname().machine)
    if arch is None:
        return False
    audit_arch, nr_socket, nr_io_uring = arch
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    kill, allow, eacces = 0x80000000, 0x7FFF0000, 0x00050000 | 13
    prog = [
        (ld, 0, 0, 4), (jeq, 1, 0, audit_arch), (ret, 0, 0, kill),
        (ld, 0, 0, 0), (jge, 0, 1, 0x40000000), (ret, 0, 0, kill),  # x32 syscalls
        (jeq, 3, 0, nr_io_uring), (jeq, 0, 3, nr_socket),
        (ld, 0, 0, 16), (jeq, 1, 0, 1),  # args[0] == AF_UNIX
        (ret, 0, 0, eacces), (ret, 0, 0, allow),
    ]
    filt = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in prog))
    fprog = struct.pack("HxxxxxxP", len(prog), ctypes.addressof(filt))
    return libc.prctl(_PR_SET_SECCOMP, 2, ctypes.c_char_p(fprog), 0, 0) == 0


def _nproc_limit(cap: int, isolated: bool) -> int:
    """RLIMIT_NPROC counts the uid's tasks outside a user namespace: allow cap more."""
    if isolated:
        return cap
    uid, tasks = os.getuid(), 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                tasks += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return tasks + cap


def _set_limits(limits: Mapping[str, int], cpu_s: int, nproc: int) -> None:
    mib = 1 << 20
    for which, value in (
        (resource.RLIMIT_CPU, cpu_s),
        (resource.RLIMIT_AS, limits["memory_mb"] * mib),
        (resource.RLIMIT_FSIZE, limits["max_file_mb"] * mib),
        (resource.RLIMIT_NOFILE, limits["max_open_files"]),
        (resource.RLIMIT_NPROC, nproc),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(which, (value, value))


def _launch(spec: dict[str, Any]) -> NoReturn:
    libc = _libc()
    # The launcher dies with the run (rpk.lifetime, inlined: only the standard library
    # is importable here); the program dies with the launcher (below).
    parent = os.getppid()
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(_SETUP_FAILED)
    workdir, uid = spec["dir"], spec["uid"]
    root = os.geteuid() == 0
    got: dict[str, Any] = {"user_namespace": not root and _enter_user_namespace(libc)}
    got["net_namespace"] = _unshare(libc, _CLONE_NEWNET)
    got["pid_namespace"] = _unshare(libc, _CLONE_NEWPID)
    got["uid_drop"] = False
    if root:
        try:
            os.chown(workdir, uid, uid)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            got["uid_drop"] = True
        except OSError:
            pass
    nproc = _nproc_limit(spec["limits"]["max_processes"], got["user_namespace"] or got["uid_drop"])
    child = os.fork()
    if child == 0:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        got["landlock_abi"] = _landlock(libc, workdir)
        got["seccomp"] = _seccomp(libc)
        missing = [k for k, v in spec["require"].items() if v and not got[k]]
        if spec["probe"]:
            print(json.dumps(got), flush=True)
        elif missing:
            sys.stderr.write(f"sandbox set-up failed: {', '.join(missing)} unavailable\n")
            os._exit(_SETUP_FAILED)
        _set_limits(spec["limits"], spec["cpu_s"], nproc)
        os.chdir(workdir)
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        os.execve(spec["argv"][0], spec["argv"], env)
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)


# --- the parent side: asyncio, in the trainer ---------------------------------------------


def leftover_pids(pgid: int, uid: int | None = None) -> list[int]:
    """Processes still in the run's session or group, or running under its uid (a
    blocking /proc scan)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # the fields after (comm)
            owner = os.stat(f"/proc/{pid}").st_uid
        except (OSError, IndexError):
            continue
        if fields[0] in "ZX":
            continue  # dead, waiting for its parent to reap it
        if pgid in (int(fields[2]), int(fields[3])) or (uid is not None and owner == uid):
            found.append(int(pid))
    return found


def _kill_all(pgid: int, uid: int | None) -> None:
    """SIGKILL the run's group and, with its own uid, everything of that uid, until none."""
    for _ in range(100):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        pids = leftover_pids(pgid, uid)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not pids:
            return
        time.sleep(0.01)
    raise RuntimeError(f"sandbox processes {pids} (group {pgid}, uid {uid}) survive SIGKILL")


# This file, which the sandbox process runs (`_launch`), resolved once at import.
_LAUNCHER = os.path.abspath(__file__)


def _make_workdir(base: str, files: Mapping[str, str]) -> str:
    """A fresh directory under `base` holding `files` (removed again if a write fails)."""
    workdir = tempfile.mkdtemp(prefix="rpk-sandbox-", dir=base)
    try:
        for name, text in files.items():
            with open(os.path.join(workdir, name), "w") as f:
                f.write(text)
    except BaseException:
        shutil.rmtree(workdir, True)
        raise
    return workdir


async def _read_capped(stream: asyncio.StreamReader, cap: int, overflow: asyncio.Event) -> bytes:
    """Keep the first cap bytes; read on to EOF so that the pipe closes cleanly."""
    buf = bytearray()
    while chunk := await stream.read(1 << 16):
        room = cap - len(buf)
        buf += chunk[:room]
        if len(chunk) > room:
            overflow.set()
    return bytes(buf)


async def _feed(stream: asyncio.StreamWriter, data: bytes) -> None:
    try:
        stream.write(data)
        await stream.drain()
        stream.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the program exited without reading all of its input


class Sandbox:
    """Runs programs one per sandbox process, at most `concurrency` at once."""

    def __init__(
        self, limits: Limits = Limits(), concurrency: int = 0, python: str = "",
        uid_base: int = 60000, workdir: str = "",
    ) -> None:
        self.limits = limits
        self._python = python
        self._uid_base = uid_base
        self._workdir = workdir or tempfile.gettempdir()
        self._free: asyncio.Queue[int] = asyncio.Queue()
        for slot in range(concurrency or os.cpu_count() or 1):
            self._free.put_nowait(slot)
        self._isolation: Isolation | None = None
        self._probe_lock = asyncio.Lock()

    async def probe(self) -> Isolation:
        """Detect the layers this machine allows (once); SandboxUnavailable if too few."""
        async with self._probe_lock:
            if self._isolation is None:
                self._isolation = await self._probe()
        return self._isolation

    async def _probe(self) -> Isolation:
        # The trainer's interpreter may sit where an unprivileged uid cannot reach it (a
        # pyenv under /root): then fall back to the system's.
        system = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or ""
        candidates = [self._python] if self._python else [sys.executable, system]
        errors = []
        for python in filter(None, dict.fromkeys(candidates)):
            try:
                got = await self._spawn(
                    [python, "-I", "-S", "-c", "print('ok')"], {}, b"", 10.0,
                    require={}, probe=True, python=python,
                )
            except OSError as e:  # not there, or not executable
                errors.append(f"{python}: {e}")
                continue
            lines = got.stdout.decode(errors="replace").splitlines()
            if got.ok and lines[-1:] == ["ok"]:
                iso = Isolation(**json.loads(lines[0]), python=python)
                break
            errors.append(f"{python}: {got.status} {got.returncode} {got.stderr[-300:]!r}")
        else:
            raise SandboxUnavailable(f"no interpreter runs in the sandbox: {'; '.join(errors)}")
        if not iso.network_blocked:
            raise SandboxUnavailable(f"no way to cut the network off here: {iso}")
        if os.geteuid() == 0 and not iso.uid_drop:
            raise SandboxUnavailable(f"running as root but cannot drop to uid {self._uid_base}: "
                                     f"RLIMIT_NPROC would not bind ({iso})")
        return iso

    async def run(
        self, files: Mapping[str, str], args: Sequence[str], stdin: str, timeout_s: float
    ) -> ProgramRun:
        """Write files into a fresh directory and run `python <args>` there."""
        iso = await self.probe()
        return await self._spawn(
            [iso.python, "-I", "-B", *args], files, stdin.encode(), timeout_s,
            require=iso.required(), probe=False, python=iso.python,
        )

    async def _spawn(
        self, argv: list[str], files: Mapping[str, str], stdin: bytes, timeout_s: float,
        require: Mapping[str, Any], probe: bool, python: str,
    ) -> ProgramRun:
        slot = await self._free.get()
        uid = self._uid_base + slot if os.geteuid() == 0 else None
        workdir: str | None = None
        try:
            # On a thread: a file system can block, and the loop serves every other reward.
            workdir = await asyncio.to_thread(_make_workdir, self._workdir, files)
            spec = {
                "dir": workdir, "uid": uid, "limits": asdict(self.limits), "argv": argv,
                "cpu_s": math.ceil(timeout_s) + 1, "require": dict(require), "probe": probe,
            }
            proc = await asyncio.create_subprocess_exec(
                python, "-I", "-S", _LAUNCHER, json.dumps(spec),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, start_new_session=True, cwd=workdir,
                env={"PATH": "/usr/bin:/bin"},
            )
            return await self._communicate(proc, stdin, timeout_s, uid)
        finally:
            if workdir is not None:
                await asyncio.to_thread(shutil.rmtree, workdir, True)
            self._free.put_nowait(slot)

    async def _communicate(
        self, proc: asyncio.subprocess.Process, stdin: bytes, timeout_s: float, uid: int | None
    ) -> ProgramRun:
        assert proc.stdin and proc.stdout and proc.stderr
        start = time.monotonic()
        overflow = asyncio.Event()
        feeder = asyncio.create_task(_feed(proc.stdin, stdin))
        cap = self.limits.max_output_kb << 10
        readers = [
            asyncio.create_task(_read_capped(s, cap, overflow)) for s in (proc.stdout, proc.stderr)
        ]
        waiter = asyncio.create_task(proc.wait())
        flagged = asyncio.create_task(overflow.wait())
        try:
            done, _ = await asyncio.wait(
                {waiter, flagged}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            wall_s = time.monotonic() - start
            status = "exited" if waiter in done else "output_limit" if done else "timeout"
        finally:
            await asyncio.to_thread(_kill_all, proc.pid, uid)  # when cancelled too
            feeder.cancel()
            flagged.cancel()
        try:
            await proc.wait()
            # Every writer is dead, so the pipes reach EOF; the bound only guards the
            # reader against a descendant that escaped both the group and the uid.
            finished, _ = await asyncio.wait(readers, timeout=2.0)
        finally:
            for task in (waiter, *readers):
                task.cancel()
        out, err = (t.result() if t in finished else b"" for t in readers)
        code = proc.returncode if status == "exited" else None
        if code == _SETUP_FAILED:
            raise SandboxUnavailable(err.decode(errors="replace").strip())
        return ProgramRun(status, code, out, err, wall_s, proc.pid)


if __name__ == "__main__":
    _launch(json.loads(sys.argv[1]))
