"""Run untrusted Python programs (written by the model being trained) and judge and time them.

The candidate runs in a separate process that only receives inputs and returns outputs over
a pipe; the judge (comparison with expected outputs, timing, limits) is this module, in the
trainer's process, where the candidate cannot reach it:

    trainer (judge)  --pickle frames on stdin-->  child: compile candidate, call solve(*args)
                     <--JSON frames on a pipe---  (stdout/stderr are drained, capped, kept apart)

Statuses, worst first: no_program, compile_error, runtime_error, timeout, memory_limit,
wrong_output, correct (with a runtime in seconds).

Isolation, the strongest the platform gives (`isolation()` says which one is in use):

- "namespaces" (root with CAP_SYS_ADMIN, as on this project's machines): new network, pid,
  mount, IPC and UTS namespaces (unshare(2) via ctypes); every mount read-only in that view,
  private tmpfs over /tmp, /var/tmp and /dev/shm (the candidate's scratch directory is
  /tmp/work in that tmpfs, gone when the namespace dies), a fresh /proc, then the child drops
  to a fresh unprivileged uid (random, one per run) with no capabilities and no
  supplementary groups.
- "userns" (no root, unprivileged user namespaces allowed): the same namespaces inside a
  user namespace, then a nested user namespace so that the candidate cannot undo the mounts.
  The process-count limit then counts all processes of the trainer's user (it is set to the
  current count plus the limit).
- "process" (neither works): a separate session with rlimits only; as root the child still
  drops to a fresh uid. Its scratch directory is a mkdtemp folder removed afterwards.
  NOT protected in this mode: network access (AF_UNIX aside, see below), reading and writing
  world-readable/writable paths (/tmp, /var/tmp, /dev/shm, /run/lock: files there outlive the
  run, a channel from one judging to the next), seeing the machine's processes, and (when the
  trainer is not root) everything the trainer's user may do to its files and processes.

Every mode: a minimal environment (no variable of the trainer's), `python -I -S` (no site
packages, no PYTHON* variables, standard library only), rlimits on address space
(RLIMIT_AS), CPU time, process count (RLIMIT_NPROC), file size and core dumps; a wall-clock
limit per call and per run enforced by the judge (extended by the time the program waited for
a CPU held by other load, at most LOAD_GRACE times), which kills the whole process group, the
pid namespace (by killing its init) or, in "process" mode, every process of the sandbox uid;
no_new_privs and a seccomp filter (`seccomp_filter`) that denies, with EPERM, the kernel state
that outlives a process and that no namespace here hides: keyrings (add_key, request_key,
keyctl), SysV IPC and POSIX message queues (private in the namespace modes, the host's in
"process" mode), unix sockets (host services by path), io_uring; and any call of another ABI
(i386, x32) with ENOSYS. docs/rlpf.md has the table of what each mode isolates.

What the candidate cannot do: patch the clock (timing is read by the judge: the kernel's
account of the CPU time of the candidate's process during a call, input decoding included, or
the judge's wall clock around the round trip; see `timed_call`), patch the comparison
(expected outputs never leave the judge; replies are parsed as plain JSON, so no candidate
__eq__ ever runs in the judge),
report success by exiting early with status 0 (the judge needs one reply per input), see
inputs before it is called with them, or keep answers from one run to the next (a fresh
process and scratch directory per run; timing inputs differ between repeats, so memoising
answers inside a run does not shorten a timed call), or hide work from the CPU-time clock in
threads or child processes (such a program is timed by wall clock; see `timed_call` for the
one gap left).

What it does not protect against: kernel exploits or side channels; a candidate that
computes the answers honestly but special-cases the visible inputs (that is an oracle-quality
problem, not a sandbox one); timing noise from other load on the machine (reduced, not
removed: the CPU-time clock leaves out time spent waiting for a CPU, the programs of a round
share one CPU, references are re-timed in the same interleaved rounds, and rlpf.py calibrates
a noise floor per task); memory held in page cache or pipes outside RLIMIT_AS. There is no cgroup
(total memory of a fork tree is bounded only by RLIMIT_AS x RLIMIT_NPROC).
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import selectors
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

STATUSES = ("no_program", "compile_error", "runtime_error", "timeout", "memory_limit", "wrong_output", "correct")
MAX_REPLY_BYTES = 8 << 20


@dataclass
class Limits:
    """Resource limits of one sandboxed run."""

    call_s: float = 2.0
    """wall-clock seconds allowed for one call (and for compiling the program), plus the time the program waited
    for a CPU held by other load (at most LOAD_GRACE x call_s more)"""
    run_s: float = 20.0
    """wall-clock seconds allowed for the whole run (all calls), extended by load in the same way"""
    cpu_s: int = 20
    """CPU seconds of the child (RLIMIT_CPU)"""
    memory_mb: int = 256
    """address space of each child process (RLIMIT_AS), in MiB"""
    nproc: int = 1
    """processes and threads the candidate may have, itself included (RLIMIT_NPROC, enforced by the kernel in the
    namespace modes): 1 = no fork and no thread, so that no work can run outside the process the judge times"""
    output_bytes: int = 16_384
    """stdout and stderr kept per run (the rest is read and dropped)"""
    file_mb: int = 16
    """largest file the candidate may write (RLIMIT_FSIZE); also the size of the private /tmp"""
    mode: str = "auto"
    """'auto' (strongest that works), 'namespaces', 'userns' or 'process'"""
    label: str = ""
    """shown in the child's command line (ps), to find one caller's sandbox processes"""


SECCOMP_ARCHES = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
"""AUDIT_ARCH_* of the ABIs the seccomp filter knows (the syscall numbers below are theirs)."""
DENIED_SYSCALLS = {
    # kernel keyrings: keys are global objects (every namespace lists their serials in /proc/keys), a fresh uid's
    # user keyring stays until reboot, and the trainer's session keyring is inherited: a key one judging added and
    # made readable was read by the next; request_key can also start a helper program outside the sandbox
    "add_key": (248, 217), "request_key": (249, 218), "keyctl": (250, 219),
    # SysV IPC and POSIX message queues: objects outlive their creator; only the namespace modes' IPC namespace
    # hides the host's and is gone with the run, so "process" mode shared them between judgings
    "shmget": (29, 194), "shmat": (30, 196), "shmctl": (31, 195), "shmdt": (67, 197),
    "semget": (64, 190), "semop": (65, 193), "semctl": (66, 191), "semtimedop": (220, 192),
    "msgget": (68, 186), "msgsnd": (69, 189), "msgrcv": (70, 188), "msgctl": (71, 187),
    "mq_open": (240, 180), "mq_unlink": (241, 181), "mq_timedsend": (242, 182), "mq_timedreceive": (243, 183),
    "mq_notify": (244, 184), "mq_getsetattr": (245, 185),
    # io_uring can open sockets without the socket call, past the AF_UNIX rule below
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
}
"""System calls the candidate may not make, in every isolation mode: (x86_64 number, aarch64 number). Each
returns EPERM. Also denied: socket(AF_UNIX, ...), since unix sockets reach the host's services by path in every
mode (a network namespace hides only abstract ones, and "process" mode has none)."""
SOCKET_NR = (41, 198)


def seccomp_filter(machine: str | None = None) -> bytes:
    """The classic-BPF program (struct sock_filter[]) the child installs before any candidate code runs: EPERM
    for DENIED_SYSCALLS and socket(AF_UNIX), ENOSYS for any call of another ABI (i386's `int 0x80`, x86_64's x32
    numbers with bit 30 set: their numbers differ, so they are refused as a whole), everything else allowed."""
    machine = machine or os.uname().machine
    if machine not in SECCOMP_ARCHES or struct.calcsize("P") != 8:
        raise RuntimeError(f"the sandbox's seccomp filter knows the system calls of 64-bit x86_64 and aarch64 "
                           f"only, not {machine} ({8 * struct.calcsize('P')}-bit Python)")
    col = list(SECCOMP_ARCHES).index(machine)
    LD, JEQ, JGE, RET = 0x20, 0x15, 0x35, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_JMP|BPF_JGE|BPF_K,
    # BPF_RET|BPF_K
    NR, ARCH, ARG0 = 0, 4, 16  # offsets in struct seccomp_data (ARG0: the low half of args[0], little-endian)
    # (code, jump if true, jump if false, k); a jump names its target, resolved into an offset at the end
    prog = [(LD, 0, 0, ARCH), (JEQ, "next", "nosys", SECCOMP_ARCHES[machine]), (LD, 0, 0, NR)]
    if machine == "x86_64":
        prog.append((JGE, "nosys", "next", 0x40000000))
    prog += [(JEQ, "deny", "next", nrs[col]) for nrs in DENIED_SYSCALLS.values()]
    prog += [(JEQ, "next", "allow", SOCKET_NR[col]), (LD, 0, 0, ARG0), (JEQ, "deny", "allow", 1)]  # AF_UNIX: 1
    labels = {"allow": len(prog), "deny": len(prog) + 1, "nosys": len(prog) + 2}
    prog += [(RET, 0, 0, 0x7FFF0000), (RET, 0, 0, 0x00050000 | errno.EPERM), (RET, 0, 0, 0x00050000 | errno.ENOSYS)]
    out = b""
    for i, (code, jt, jf, k) in enumerate(prog):
        jt, jf = (0 if j in (0, "next") else labels[j] - i - 1 for j in (jt, jf))
        out += struct.pack("=HBBI", code, jt, jf, k)
    return out


# The child: trusted code that runs first in the sandbox process, sets it up, then loads the
# candidate and serves calls. Runs under `python -I -S -c`, so it imports nothing from disk
# besides the standard library.
CHILD_SRC = r'''
import ctypes, json, os, pickle, resource, struct, sys
import bisect, collections, functools, heapq, itertools, math, operator, random, re, string, array  # preloaded
cfg = json.loads(sys.argv[1])
if cfg["mode"] != "namespaces":  # the standard library may be out of the sandbox uid's reach: preload the usual
    import signal, socket, subprocess, time, decimal, fractions, statistics, copy, typing, dataclasses, encodings.idna
sys.dont_write_bytecode = True
rfd, wfd = 0, cfg["wfd"]
libc = ctypes.CDLL(None, use_errno=True)
NS = {"net": 0x40000000, "pid": 0x20000000, "mnt": 0x00020000, "ipc": 0x08000000, "uts": 0x04000000,
      "user": 0x10000000}

def die(msg):
    os.write(2, ("sandbox setup: " + msg + "\n").encode())
    os._exit(97)

def check(rc, what):
    if rc != 0:
        die(what + ": " + os.strerror(ctypes.get_errno()))

def send(obj):
    data = json.dumps(obj).encode()
    os.write(wfd, struct.pack("<I", len(data)) + data)

def write_map(path, text):
    with open(path, "w") as f:
        f.write(text)

uid, mode = cfg["uid"], cfg["mode"]
if mode in ("namespaces", "userns"):
    flags = NS["net"] | NS["pid"] | NS["mnt"] | NS["ipc"] | NS["uts"]
    if mode == "userns":
        if os.geteuid() == 0:  # root testing this path: become an ordinary user first
            os.setgroups([]); os.setgid(uid); os.setuid(uid)
            libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: a uid change makes /proc/self root-owned
        outer_uid, outer_gid = os.geteuid(), os.getegid()
        check(libc.unshare(NS["user"] | flags), "unshare")
        write_map("/proc/self/setgroups", "deny")
        write_map("/proc/self/uid_map", "0 %d 1" % outer_uid)
        write_map("/proc/self/gid_map", "0 %d 1" % outer_gid)
    else:
        check(libc.unshare(flags), "unshare")
    child = os.fork()
    if child:  # outside the pid namespace: tell the judge the init's pid, then wait for it
        send({"pid": child})
        os.close(wfd); os.close(0)
        _, st = os.waitpid(child, 0)
        os._exit(os.waitstatus_to_exitcode(st) if os.WIFEXITED(st) else 128 + os.WTERMSIG(st))
    os.setsid()
    MS_REC, MS_PRIVATE, MS_NOSUID, MS_NODEV, MS_NOEXEC = 16384, 1 << 18, 2, 4, 8
    MS_BIND, MS_REMOUNT, MS_RDONLY = 4096, 32, 1
    check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    # every mount read-only in this namespace (a bind remount changes this namespace's view, not the host's
    # filesystem), so that nothing the candidate writes outlives the run: world-writable folders such as
    # /run/lock would otherwise carry files from one judging to the next, and onto the host
    KEEP = {"nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21,
            "strictatime": 1 << 24}  # flags a remount must repeat (a user namespace may not drop them)
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        target = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY | sum(KEEP.get(o, 0) for o in fields[5].split(","))
        if libc.mount(None, target.encode(), None, flags, None) != 0 and os.path.lexists(target):
            die("read-only remount of " + target + ": " + os.strerror(ctypes.get_errno()))
    opts = ("size=%dm,mode=1777" % cfg["file_mb"]).encode()
    for d in cfg["tmpfs"]:
        if os.path.isdir(d):
            check(libc.mount(b"tmpfs", d.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts), "tmpfs on " + d)
    check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), "mount /proc")
    # the standard library may sit under a directory the sandbox uid cannot enter (/root/.pyenv):
    # expose it read-only at a path it can reach
    for i, src in enumerate(list(sys.path)):
        dst = "/tmp/.stdlib%d" % i
        if os.path.isdir(src) and "/tmp" in cfg["tmpfs"]:
            os.mkdir(dst, 0o755)
            if libc.mount(src.encode(), dst.encode(), None, MS_BIND | MS_REC, None) == 0:
                libc.mount(None, dst.encode(), None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_REC, None)
                sys.path[i] = dst
                for mod in list(sys.modules.values()):  # packages already imported (encodings) look there too
                    path = getattr(mod, "__path__", None)
                    if isinstance(path, list):
                        path[:] = [dst + q[len(src):] if q.startswith(src) else q for q in path]
    os.mkdir("/tmp/work", 0o700)
    if mode == "namespaces":
        os.chown("/tmp/work", uid, uid)
    os.chdir("/tmp/work")
    os.environ["HOME"] = os.environ["TMPDIR"] = "/tmp/work"
else:
    os.chdir(cfg["scratch"])

for res, val in ((resource.RLIMIT_AS, cfg["memory_mb"] << 20), (resource.RLIMIT_CPU, cfg["cpu_s"]),
                 (resource.RLIMIT_FSIZE, cfg["file_mb"] << 20), (resource.RLIMIT_CORE, 0),
                 (resource.RLIMIT_NPROC, cfg["nproc"]), (resource.RLIMIT_NOFILE, 64)):
    resource.setrlimit(res, (val, val + (res == resource.RLIMIT_CPU)))  # CPU: SIGXCPU first, SIGKILL 1 s later
if mode == "userns":  # nested user namespace: no capability over the mounts made above
    check(libc.unshare(NS["user"]), "unshare user")
    write_map("/proc/self/setgroups", "deny")
    write_map("/proc/self/uid_map", "1000 0 1")
    write_map("/proc/self/gid_map", "1000 0 1")
    # the kernel counts RLIMIT_NPROC per user namespace: in this fresh one the candidate is the only process
    resource.setrlimit(resource.RLIMIT_NPROC, (cfg["own_nproc"], cfg["own_nproc"]))
elif os.geteuid() == 0:
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
# last step of the setup, before any candidate code: no new privileges (setuid binaries), then the seccomp filter
# (sandbox.seccomp_filter), which this process and all it starts keep
check(libc.prctl(ctypes.c_int(38), ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)),
      "PR_SET_NO_NEW_PRIVS")
class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
prog = bytes.fromhex(cfg["seccomp"])
check(libc.prctl(ctypes.c_int(22), ctypes.c_ulong(2), ctypes.byref(SockFprog(len(prog) // 8, prog)),
                 ctypes.c_ulong(0), ctypes.c_ulong(0)), "seccomp filter")  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
if mode == "process":
    send({"pid": os.getpid()})
send({"setup": "ok"})

def read_exact(n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(rfd, n - len(buf))
        if not chunk:
            os._exit(0)
        buf += chunk
    return buf

def recv():
    return pickle.loads(read_exact(struct.unpack("<I", read_exact(4))[0]))

def describe(e):
    return (type(e).__name__ + ": " + str(e))[:300]

source = recv()
namespace = {"__name__": "__candidate__", "__builtins__": __builtins__}
try:
    code = compile(source, "<candidate>", "exec")
except (SyntaxError, ValueError, MemoryError, RecursionError, OverflowError) as e:
    send({"status": "compile_error", "msg": describe(e)}); os._exit(0)
try:
    exec(code, namespace)
    fn = namespace[cfg["entry"]]
    send({"status": "ready"})
except MemoryError as e:
    send({"status": "memory_limit", "msg": describe(e)}); os._exit(0)
except BaseException as e:
    send({"status": "runtime_error", "msg": describe(e)}); os._exit(0)
del source, code
while True:
    args = recv()
    try:
        out = json.dumps({"status": "ok", "value": fn(*args)})
    except MemoryError as e:
        out = json.dumps({"status": "memory_limit", "msg": describe(e)})
    except RecursionError as e:
        out = json.dumps({"status": "runtime_error", "msg": describe(e)})
    except BaseException as e:
        out = json.dumps({"status": "runtime_error", "msg": describe(e)})
    try:
        sys.stdout.flush(); sys.stderr.flush()
    except BaseException:
        pass
    data = out.encode()
    os.write(wfd, struct.pack("<I", len(data)) + data)
'''


@dataclass
class Proc:
    """One live sandboxed child."""

    popen: subprocess.Popen
    rfd: int
    wfd: int
    uid: int
    mode: str
    scratch: str
    deadline: float
    inner_pid: int = 0
    out: dict = field(default_factory=lambda: {"stdout": b"", "stderr": b""})
    run_s: float = 0.0
    output_bytes: int = 0
    cpu_s: int = 0
    done: bool = False
    setup_done: bool = False
    buf: bytes = b""
    eof: set = field(default_factory=set)
    sched_start: tuple | None = None
    """the kernel's accounting of the process at its first timed call (`timed_call`)"""
    sched_setup: tuple | None = None
    """the same when the trusted setup was done, before any candidate code ran"""
    sched_before: tuple | None = None
    """the same at the start of the latest timed call"""


_ISOLATION: dict = {}


def _fresh_uid() -> int:
    """A uid of its own for each run (so RLIMIT_NPROC and the final sweep concern that run only);
    `nobody` where this machine's user namespace does not map high uids."""
    try:
        with open("/proc/self/uid_map") as f:
            top = max(int(a) + int(n) for _, a, n in (line.split() for line in f))
    except (OSError, ValueError):
        top = 0
    return random.SystemRandom().randrange(200_000, 2_000_000) if top > 2_000_000 else 65534


def start(source: str, limits: Limits, entry: str = "solve") -> tuple[Proc, dict]:
    """Start a child, send it the program, and return it with its first reply (ready or a failure)."""
    mode = isolation() if limits.mode == "auto" else limits.mode
    return _start(source, limits, entry, mode)


def _start(source: str, limits: Limits, entry: str, mode: str) -> tuple[Proc, dict]:
    seccomp = seccomp_filter()
    uid = _fresh_uid() if os.geteuid() == 0 else os.geteuid()
    scratch = ""
    if mode == "process":
        scratch = tempfile.mkdtemp(prefix="tinypost-sandbox-")
        if os.geteuid() == 0:
            os.chown(scratch, uid, uid)
    nproc = limits.nproc
    if os.geteuid() != 0:  # RLIMIT_NPROC counts every process of this user
        nproc += _count_processes(os.geteuid())
    tmpfs = [d for d in ("/tmp", "/var/tmp", "/dev/shm") if not sys.base_prefix.startswith(d + "/")]
    r_fd, w_fd = os.pipe()
    cfg = dict(wfd=w_fd, uid=uid, mode=mode, scratch=scratch, memory_mb=limits.memory_mb, cpu_s=limits.cpu_s,
               file_mb=limits.file_mb, nproc=nproc, own_nproc=limits.nproc, entry=entry, tmpfs=tmpfs,
               label=limits.label, seccomp=seccomp.hex())
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": scratch or "/", "TMPDIR": scratch or "/tmp"}
    popen = subprocess.Popen([sys.executable, "-I", "-S", "-c", CHILD_SRC, json.dumps(cfg)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(w_fd,), env=env,
                             cwd=scratch or "/", start_new_session=True, close_fds=True)
    os.close(w_fd)
    for f in (popen.stdin, popen.stdout, popen.stderr):
        os.set_blocking(f.fileno(), False)
    p = Proc(popen, r_fd, popen.stdin.fileno(), uid, mode, scratch, time.monotonic() + limits.run_s,
             run_s=limits.run_s, output_bytes=limits.output_bytes, cpu_s=limits.cpu_s)
    # setup phase, before any candidate code exists in the child: the pid to kill and "setup done", in either
    # order (in the namespace modes they come from two processes)
    setup_s, got = max(limits.call_s, 10.0), {}
    while len(got) < 2:
        frame = _reply(p, limits, setup_s)
        if isinstance(frame.get("pid"), int) and "pid" not in got:
            got["pid"] = p.inner_pid = frame["pid"]
        elif frame.get("setup") == "ok" and "setup" not in got:
            got["setup"] = True
        else:
            kill(p)
            raise RuntimeError(f"sandbox ({mode}) could not start: {frame.get('status')} {frame.get('msg')} "
                               f"{p.out['stderr'].decode(errors='replace')[-500:]}".strip())
    p.setup_done = True
    p.sched_setup = _sched(p.inner_pid) if mode != "process" else None
    waited0 = _run_delay(p.inner_pid)
    try:
        sent = _send(p, source, limits.call_s)
    except OSError:
        sent = True  # the child is gone; _reply says why
    return p, (_reply(p, limits, limits.call_s, waited0) if sent else _timed_out(p, limits.call_s))


def _count_processes(uid: int) -> int:
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                n += os.stat(f"/proc/{pid}").st_uid == uid
            except OSError:
                pass
    return n


def _send(p: Proc, obj, timeout: float) -> bool:
    """Write one frame without ever blocking past the deadline (a child that stops reading cannot hang us)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(struct.pack("<I", len(data)) + data)
    deadline = min(time.monotonic() + timeout, p.deadline)
    with selectors.DefaultSelector() as sel:
        sel.register(p.wfd, selectors.EVENT_WRITE)
        while view:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                return False
            try:
                view = view[os.write(p.wfd, view):]
            except BlockingIOError:
                continue
    return True


LOAD_GRACE = 2.0
"""A call's (and a run's) wall-clock limit is extended by the time the program stood in a run queue while other
load had the CPU, by at most this many times the limit: machine load alone does not time a program out."""


def _run_delay(pid: int) -> int | None:
    """Nanoseconds the process has waited in a run queue since it started (/proc/<pid>/schedstat); None if unknown."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _deadline(p: Proc, t0: float, timeout: float, waited0: int | None) -> float:
    """When a reply awaited since t0 is late: t0 + timeout and the run's deadline, each extended by the process's
    run-queue wait (since t0, and since it started), at most LOAD_GRACE times the limit."""
    waited = _run_delay(p.inner_pid) if p.inner_pid and waited0 is not None else None
    if waited is None:
        return min(t0 + timeout, p.deadline)
    call_extra = min((waited - waited0) * 1e-9, LOAD_GRACE * timeout)
    return min(t0 + timeout + call_extra, p.deadline + min(waited * 1e-9, LOAD_GRACE * p.run_s))


def _reply(p: Proc, limits: Limits, timeout: float, waited0: int | None = None) -> dict:
    """Wait for one reply frame, draining stdout/stderr; a dict with 'status' (or 'pid'), never raises.
    `waited0`: the process's run-queue wait when the wait began, to extend the limits by load (`_deadline`)."""
    t0 = time.monotonic()
    deadline = min(t0 + timeout, p.deadline)
    sel = selectors.DefaultSelector()
    sel.register(p.rfd, selectors.EVENT_READ, "reply")
    for name, f in (("stdout", p.popen.stdout), ("stderr", p.popen.stderr)):
        if not f.closed and name not in p.eof:
            sel.register(f.fileno(), selectors.EVENT_READ, name)
    try:
        while True:
            if len(p.buf) >= 4:
                n = struct.unpack("<I", p.buf[:4])[0]
                if n > MAX_REPLY_BYTES:
                    return {"status": "wrong_output", "msg": f"reply of {n} bytes is over the limit"}
                if len(p.buf) >= 4 + n:
                    frame, p.buf = p.buf[4 : 4 + n], p.buf[4 + n :]
                    try:
                        reply = json.loads(frame)
                    except (ValueError, RecursionError):
                        return {"status": "wrong_output", "msg": "reply is not JSON"}
                    if not isinstance(reply, dict) or not ({"status", "pid", "setup"} & set(reply)):
                        return {"status": "wrong_output", "msg": "malformed reply"}
                    if "pid" in reply and not isinstance(reply["pid"], int):
                        return {"status": "wrong_output", "msg": "malformed reply"}
                    return reply
            left = deadline - time.monotonic()
            if left <= 0:
                deadline = _deadline(p, t0, timeout, waited0)
                left = deadline - time.monotonic()
                if left <= 0:
                    return _timed_out(p, timeout)
            for key, _ in sel.select(left):
                try:
                    chunk = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                if key.data == "reply":
                    if not chunk:
                        return _died(p, limits)
                    p.buf += chunk
                elif not chunk:
                    sel.unregister(key.fd)
                    p.eof.add(key.data)
                else:
                    kept = p.out[key.data]
                    p.out[key.data] = kept + chunk[: max(0, p.output_bytes - len(kept))]
    finally:
        sel.close()


def _timed_out(p: Proc, timeout: float) -> dict:
    kill(p)
    return {"status": "timeout", "msg": f"no reply within {timeout:.3g} s (or the run's {p.run_s:.3g} s)"}


def _died(p: Proc, limits: Limits) -> dict:
    """The child closed its reply pipe: classify why (it cannot claim success this way)."""
    rc, cpu = _reap(p, 1.0)
    kill(p)
    err = p.out["stderr"].decode(errors="replace")
    if not p.setup_done:  # only the trusted setup code had run: not the candidate's fault
        return {"status": "sandbox_error", "msg": f"exit code {rc}"}
    if "MemoryError" in err:
        return {"status": "memory_limit", "msg": "MemoryError"}
    if rc in (-signal.SIGXCPU, 128 + signal.SIGXCPU) or (
            rc in (-signal.SIGKILL, 128 + signal.SIGKILL) and cpu >= p.cpu_s):  # a namespace's init ignores SIGXCPU
        return {"status": "timeout", "msg": f"CPU time limit ({cpu:.1f} s)"}
    return {"status": "runtime_error", "msg": f"the program exited (code {rc}) before replying"}


def _reap(p: Proc, timeout: float) -> tuple:
    """Wait up to `timeout` for the child to exit: (exit code or None, CPU seconds of it and its reaped children)."""
    deadline = time.monotonic() + timeout
    while p.popen.returncode is None and time.monotonic() < deadline:
        pid, status, ru = os.wait4(p.popen.pid, os.WNOHANG)
        if pid:
            p.popen.returncode = os.waitstatus_to_exitcode(status)
            return p.popen.returncode, ru.ru_utime + ru.ru_stime
        time.sleep(0.005)
    return p.popen.returncode, 0.0


def _out_of_turn(p: Proc) -> bool:
    """Whether reply bytes are waiting before a call was sent (the child writes only while it serves a call, so any
    byte left after a reply was forged by the candidate); an end of file is left for `_reply` to classify."""
    if p.buf:
        return True
    with selectors.DefaultSelector() as sel:
        sel.register(p.rfd, selectors.EVENT_READ)
        if not sel.select(0):
            return False
    try:
        chunk = os.read(p.rfd, 1 << 16)
    except BlockingIOError:
        return False
    p.buf += chunk
    return bool(chunk)


def call(p: Proc, args: tuple, limits: Limits) -> tuple[dict, float]:
    """Call the candidate's entry point on `args`; the reply and the round-trip wall time in seconds."""
    if p.done:
        return {"status": "runtime_error", "msg": "the program is no longer running"}, 0.0
    if _out_of_turn(p):  # a reply queued ahead would be read as the answer to this call, in no time
        kill(p)
        return {"status": "runtime_error", "msg": "the program wrote to the judge's reply channel out of turn"}, 0.0
    waited0 = _run_delay(p.inner_pid) if p.inner_pid else None
    t0 = time.perf_counter()
    try:
        if not _send(p, tuple(args), limits.call_s):
            return _timed_out(p, limits.call_s), time.perf_counter() - t0
    except OSError:
        return _died(p, limits), 0.0
    reply = _reply(p, limits, limits.call_s, waited0)
    return reply, time.perf_counter() - t0


CLOCKS = ("cpu", "wall")
"""What a timed call counts. cpu: the CPU time the candidate's process used during the call, from the kernel's
scheduler accounting (/proc/<pid>/schedstat, nanoseconds), read by the judge; wall: the judge's round trip."""


def _sched(pid: int) -> tuple | None:
    """(ns the process's main thread spent on a CPU, threads, clock ticks of CPU of all its threads (exited ones
    included), clock ticks of its reaped children, whether it has live children), from /proc; None when that
    cannot be read (the process is gone, or the kernel keeps no scheduler accounting)."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            on_cpu = int(f.read().split()[0])
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # fields[0] is field 3 (state) of proc(5)
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = bool(f.read().strip())
        return on_cpu, int(fields[17]), int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14]), children
    except (OSError, ValueError, IndexError):
        return None


TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _off_cpu(pid: int, timeout: float = 0.05) -> int:
    """Wait (at most `timeout`) until the process is off the CPU, and return `pid`. The kernel adds a running
    task's time to the account /proc shows when it leaves the CPU (or at a tick): read while the child still runs
    after sending its reply, the account can miss the whole call (a fast call was counted 0 ns)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "R":
                    break
        except (OSError, IndexError):
            break
        time.sleep(0.0002)
    return pid


def timed_call(p: Proc, args: tuple, limits: Limits, clock: str = "cpu") -> tuple[dict, float, float | None]:
    """`call`, plus the count `clock` asks for: (reply, wall seconds, counted seconds or None).

    cpu: the CPU seconds the candidate's process spent during the call (its own work, in user and kernel mode,
    decoding the input and encoding the reply included), read by the judge from the kernel before and after;
    time the process waited for a CPU while other load ran, or was blocked, is not counted. Sound only for one
    single-threaded process that does all its work itself, so the count is None (the caller falls back to wall
    time for that program) when, at the end of the call, it has a second thread or a live child, when its reaped
    children or its exited threads have used CPU since its first timed call (seen in clock ticks), in the
    "process" isolation mode (the network and the machine's other processes are in reach there), and when the
    accounting cannot be read. These checks are a second line: in the namespace modes no second thread or process
    can start (RLIMIT_NPROC 1), which also closes what they miss (a child reaped by the kernel, whose CPU time
    reaches no parent, while the main thread waits: tested in tests/test_sandbox.py).
    """
    usable = clock == "cpu" and p.inner_pid and p.mode != "process"
    before = p.sched_before = _sched(_off_cpu(p.inner_pid)) if usable else None
    reply, wall = call(p, args, limits)
    after = _sched(_off_cpu(p.inner_pid)) if before is not None else None
    if before is None or after is None:
        return reply, wall, None
    first = p.sched_start = p.sched_start or before  # checked over all timed calls so far, so that ticks add up
    others = (after[2] - first[2]) * TICK_S > (after[0] - first[0]) * 1e-9 + TICK_S  # CPU beyond the main thread's
    if after[1] != 1 or after[4] or after[3] != first[3] or others:
        return reply, wall, None
    return reply, wall, (after[0] - before[0]) * 1e-9


def pin(p: Proc, cpu: int) -> None:
    """Run the candidate's process on one CPU from now on (all programs of a timing round share one, so that a
    CPU slowed by its neighbours slows them alike); a no-op where that is not allowed."""
    try:
        if p.inner_pid and not p.done:
            os.sched_setaffinity(p.inner_pid, {cpu})
    except OSError:
        pass


def kill(p: Proc) -> None:
    """Kill everything the child started, reap it, close the pipes; idempotent."""
    if p.done:
        return
    p.done = True
    if p.popen.poll() is None and p.inner_pid and p.mode != "process":
        try:  # the init of the pid namespace: when it dies, the kernel kills every process inside
            os.kill(p.inner_pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(p.popen.pid, signal.SIGKILL)
    except OSError:
        pass
    p.popen.wait()
    if p.mode == "process" and os.geteuid() == 0:
        _kill_uid(p.uid)
    for name, f in (("stdout", p.popen.stdout), ("stderr", p.popen.stderr)):  # what was written before the end
        while name not in p.eof and not f.closed:
            try:
                chunk = os.read(f.fileno(), 1 << 16)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            p.out[name] += chunk[: max(0, p.output_bytes - len(p.out[name]))]
    for fd in (p.rfd,):
        try:
            os.close(fd)
        except OSError:
            pass
    for f in (p.popen.stdin, p.popen.stdout, p.popen.stderr):
        try:
            f.close()
        except OSError:
            pass
    if p.scratch:
        shutil.rmtree(p.scratch, ignore_errors=True)


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of the (fresh, per-run) sandbox uid until none is left."""
    for _ in range(50):
        found = False
        for pid in os.listdir("/proc"):
            try:
                if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                    with open(f"/proc/{pid}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # dead, waiting to be reaped
                            continue
                    os.kill(int(pid), signal.SIGKILL)
                    found = True
            except OSError:
                pass
        if not found:
            return
        time.sleep(0.01)


def isolation() -> str:
    """The strongest isolation mode that works here ('namespaces', 'userns' or 'process'), probed once."""
    if "mode" not in _ISOLATION:
        seccomp_filter()  # no mode can start without it: say why once, not as three failed modes
        why = []
        for mode in ("namespaces", "userns", "process"):
            if mode == "namespaces" and os.geteuid() != 0:
                continue
            try:
                p, first = _start("def solve():\n    return 1\n", Limits(call_s=10.0), "solve", mode)
                reply, _ = call(p, (), Limits(call_s=10.0)) if first.get("status") == "ready" else (first, 0.0)
                kill(p)
            except (OSError, RuntimeError) as e:
                why.append(f"{mode}: {str(e)[-300:]}")
                continue
            if reply.get("value") == 1:
                _ISOLATION["mode"] = mode
                break
            why.append(f"{mode}: {reply}")
        else:
            raise RuntimeError("the sandbox cannot start a Python child here (" + "; ".join(why) + ")")
    return _ISOLATION["mode"]


def canonical(value):
    """`value` as the judge sees a reply: through JSON (tuples become lists)."""
    return json.loads(json.dumps(value))


@dataclass
class Verdict:
    """The judge's verdict on one program."""

    status: str
    message: str = ""
    runtime: float | None = None
    """the statistic (min or median) of the timed calls, in seconds (correct programs that were timed)"""
    times: list = field(default_factory=list)
    """every timed call as counted by `clock`, in seconds"""
    wall_times: list = field(default_factory=list)
    """every timed call's round trip, in seconds"""
    clock: str = ""
    """what `times` count: 'cpu' or 'wall' (asked for, or the fallback for a program the cpu count cannot judge)"""
    setup_cpu: float | None = None
    """CPU seconds the program spent before its first timed round (loading, the tests, the warm-up call: work no
    round counts, which a program could spend building answers ahead; code_tasks.judge charges the excess over the
    slow baseline's to every round); None where the cpu count is not used"""
    second_speedup: float | None = None
    """the paired speed-up of a second judging in fresh sandboxes (code_tasks.judge `confirm_floor`: set only when
    the first landed near the noise floor), else None"""
    floors: tuple = (1.0, 1.0)
    """noise floors of its speed-ups against the slow baseline and against the fast reference (set by the caller
    from a calibration, rlpf.py: speed-ups within these factors of 1 earn no speed credit); (1, 1): none"""
    stdout: str = ""
    stderr: str = ""


def run_program(source: str | None, tests: list, expected: list, limits: Limits, timing: list = (),
                timing_expected: list = (), entry: str = "solve", clock: str = "cpu") -> Verdict:
    """Judge one program on `tests` (args tuples) against `expected`, then time it once on each `timing` input.

    Every timing output is checked too. Use `measure` to time several programs against references.
    """
    verdicts = measure([source], tests, expected, timing, timing_expected, limits, repeats=1 if timing else 0,
                       entry=entry, clock=clock)
    return verdicts[0]


def _fail(p: Proc | None, status: str, msg: str) -> Verdict:
    v = Verdict(status, msg)
    if p is not None:
        kill(p)
        v.stdout, v.stderr = (p.out[k].decode(errors="replace") for k in ("stdout", "stderr"))
    return v


def _check_reply(reply: dict, want) -> tuple[str, str]:
    if reply.get("status") == "sandbox_error":
        raise RuntimeError(f"sandbox could not start: {reply.get('msg')}")
    if reply.get("status") != "ok":
        status = reply.get("status")
        return (status if status in STATUSES[1:6] else "runtime_error"), str(reply.get("msg", ""))[:300]
    if json.dumps(reply.get("value"), sort_keys=True) != json.dumps(want, sort_keys=True):  # 45.0 != 45, True != 1
        return "wrong_output", f"got {str(reply.get('value'))[:80]}, expected {str(want)[:80]}"
    return "ok", ""


STATISTICS = {"min": min, "median": statistics.median}
"""A program's runtime from its timed rounds. min: load and interrupts only ever add time, so the fastest round
is the least disturbed one; median: the previous method's."""


def measure(sources: list, tests: list, expected: list, timing: list, timing_expected: list, limits: Limits,
            repeats: int = 3, entry: str = "solve", time_wrong_outputs: bool = False, clock: str = "cpu",
            statistic: str = "min", pin_rounds: bool = True) -> list[Verdict]:
    """Judge several programs and time the correct ones in the same interleaved measurement.

    Each program runs in its own sandbox: the correctness tests first (they double as warm-up),
    then one warm-up call on timing[0], then `repeats` rounds; round r times every surviving
    program once on timing[r] (an input that process has not seen: a memo of earlier answers never
    hits; more rounds than inputs is an error), in a shuffled order, so that the programs of one
    round see the same load;
    with `pin_rounds` every program of a round runs on the same CPU (drawn per round). A call
    counts `clock` ('cpu': the candidate process's CPU time, see `timed_call`; 'wall': the round
    trip); a program whose cpu count cannot be trusted on some call (threads, child processes)
    is counted by wall time on every call. `times[r - 1]` is round r's count, so that programs
    can be compared round by round; `runtime` is the `statistic` ('min' or 'median') of them.
    Pass the slow and fast references among `sources` so that they are re-timed in the same rounds.
    With `time_wrong_outputs`, programs that run but give wrong outputs are timed too (for an
    ungated speed reward); their status stays wrong_output.
    """
    if clock not in CLOCKS or statistic not in STATISTICS:
        raise ValueError(f"clock {clock!r} / statistic {statistic!r}: expected one of {CLOCKS} / {list(STATISTICS)}")
    if timing and repeats > len(timing) - 1:
        raise ValueError(f"{repeats} timed rounds need {repeats + 1} timing inputs (a warm-up and one new input a "
                         f"round, so that no round can be answered from a cache), got {len(timing)}")
    expected = [canonical(e) for e in expected]
    timing_expected = [canonical(e) for e in timing_expected]
    verdicts: list = [None] * len(sources)
    procs: dict = {}

    def failed(i, status, msg):  # the first failure is the verdict; a wrong-output program keeps its timings
        v = verdicts[i] if verdicts[i] is not None and verdicts[i].status == "wrong_output" else None
        verdicts[i] = _fail(procs.pop(i), status, msg) if v is None else _finish(procs.pop(i), v, statistic)

    try:
        for i, source in enumerate(sources):
            if not source or not source.strip():
                verdicts[i] = Verdict("no_program", "no program found in the completion")
                continue
            p, first = start(source, limits, entry)
            if first.get("status") != "ready":
                status, msg = _check_reply(first, None)
                verdicts[i] = _fail(p, status, msg)
                continue
            procs[i] = p
            for args, want in zip(tests, expected):
                status, msg = _check_reply(call(p, args, limits)[0], want)
                if status == "wrong_output" and time_wrong_outputs:
                    verdicts[i] = verdicts[i] or Verdict("wrong_output", msg)
                elif status != "ok":
                    failed(i, status, msg)
                    break
        if repeats and timing:
            order_rng = random.Random(len(sources))
            cpus = sorted(os.sched_getaffinity(0))
            for r in range(repeats + 1):  # round 0 is the warm-up
                order = list(procs)
                order_rng.shuffle(order)
                cpu = order_rng.choice(cpus)
                for i in order:
                    if pin_rounds:
                        pin(procs[i], cpu)
                    reply, seconds, counted = timed_call(procs[i], timing[r], limits, clock)
                    status, msg = _check_reply(reply, timing_expected[r])
                    if status == "wrong_output" and time_wrong_outputs:
                        verdicts[i] = verdicts[i] or Verdict("wrong_output", msg)
                    elif status != "ok":
                        failed(i, status, msg)
                        continue
                    if r > 0:
                        verdicts[i] = verdicts[i] or Verdict("correct")
                        v = verdicts[i]
                        p = procs[i]
                        if r == 1 and counted is not None and p.sched_setup and p.sched_before:
                            v.setup_cpu = (p.sched_before[0] - p.sched_setup[0]) * 1e-9
                        v.wall_times.append(seconds)
                        v.clock = "wall" if counted is None or v.clock == "wall" else clock
                        v.times = list(v.wall_times) if v.clock == "wall" else v.times + [counted]
        for i in list(procs):
            verdicts[i] = _finish(procs.pop(i), verdicts[i] or Verdict("correct"), statistic)
    finally:
        for p in procs.values():
            kill(p)
    return verdicts


def _finish(p: Proc, v: Verdict, statistic: str = "min") -> Verdict:
    if v.times:
        v.runtime = STATISTICS[statistic](v.times)
    kill(p)
    v.stdout, v.stderr = (p.out[k].decode(errors="replace") for k in ("stdout", "stderr"))
    return v


def noise(times: list) -> float:
    """Relative spread of repeated timings of one program: (max - min) / median (0 for one timing)."""
    return (max(times) - min(times)) / statistics.median(times) if len(times) > 1 else 0.0
