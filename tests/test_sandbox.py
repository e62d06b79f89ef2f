"""Adversarial tests of code_env/sandbox.py: every case is a program written to break out or cheat.

Each test checks the verdict, that it came within the limit, and (autouse fixture) that nothing is
left behind: no sandbox process, no file the candidate tried to create outside its scratch dir, and no key
with this run's token in the kernel's keyrings.
"""

import ctypes
import dataclasses
import errno
import json
import os
import select
import signal
import socket
import subprocess
import time
import uuid

import pytest

from code_env import sandbox
from code_env import tasks as code_tasks

MODE = os.environ.get("TINYPOST_SANDBOX_MODE", "auto")  # force 'userns' or 'process' to test a fallback
TOKEN = uuid.uuid4().hex[:12]
LABEL = f"tp-sandbox-test-{TOKEN}"  # in the argv of this file's sandbox processes (others may run at the same time)
LIMITS = sandbox.Limits(call_s=1.0, run_s=6.0, cpu_s=6, memory_mb=256, output_bytes=4096, mode=MODE, label=LABEL)
THREADS_ALLOWED = dataclasses.replace(LIMITS, nproc=8)  # the wall-clock fallback for helpers, where they can start
TESTS, EXPECTED = [(1,), (5,), (20,)], [3, 15, 60]  # solve(n) = 3 n
TIMING = [(200_000 + i,) for i in range(4)]
TIMING_EXPECTED = [3 * a[0] for a in TIMING]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ESCAPES = [f"/tmp/tp-escape-{TOKEN}", f"/var/tmp/tp-escape-{TOKEN}", f"/dev/shm/tp-escape-{TOKEN}",
           f"/run/lock/tp-escape-{TOKEN}", f"/var/lock/tp-escape-{TOKEN}",
           os.path.join(ROOT, f"tp-escape-{TOKEN}"), os.path.expanduser(f"~/tp-escape-{TOKEN}")]
WORLD_WRITABLE = ESCAPES[:5]  # private to the sandbox in the namespace modes; the machine's in "process" mode
MARKER = LABEL.encode()
SLEEP_ARG = f"987.{int(TOKEN, 16) % 10**9}"


def namespaced() -> bool:
    return (sandbox.isolation() if MODE == "auto" else MODE) != "process"


def judge(source, limits=LIMITS):
    t0 = time.monotonic()
    v = sandbox.run_program(source, TESTS, EXPECTED, limits)
    return v, time.monotonic() - t0


def leftover_processes() -> list:
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if MARKER in cmd or (b"sleep\0" + SLEEP_ARG.encode()) in cmd:
            found.append(int(pid))
    return found


KEYCTL_LIB = r"""
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
NR = {"x86_64": dict(add_key=248, request_key=249, keyctl=250, shmget=29, msgget=68, semget=64, mq_open=240,
                     socket=41, io_uring_setup=425),
      "aarch64": dict(add_key=217, request_key=218, keyctl=219, shmget=194, msgget=186, semget=190, mq_open=180,
                      socket=198, io_uring_setup=425)}[os.uname().machine]
def sys_call(nr, *args):  # the raw system call: the result, or minus the errno
    r = libc.syscall(ctypes.c_long(nr), *(ctypes.c_long(a) if isinstance(a, int) else a for a in args))
    return r if r != -1 else -ctypes.get_errno()
def keyctl(*args):
    return sys_call(NR["keyctl"], *args)
KEYRINGS = {"thread": -1, "process": -2, "session": -3, "user": -4, "user-session": -5}
"""


def token_keys() -> list:
    """Key serials of /proc/keys (those this process may view) whose description holds this run's token."""
    with open("/proc/keys") as f:
        return [int(line.split()[0], 16) for line in f if TOKEN in line]


def invalidate(serials):  # KEYCTL_INVALIDATE: a key a candidate left behind would otherwise stay until reboot
    libc = ctypes.CDLL(None, use_errno=True)
    nr = {"x86_64": 250, "aarch64": 219}.get(os.uname().machine)
    for serial in serials:
        if nr:
            libc.syscall(ctypes.c_long(nr), ctypes.c_long(21), ctypes.c_long(serial))


@pytest.fixture(autouse=True)
def nothing_left_behind():
    yield
    left = token_keys()
    invalidate(left)
    assert left == [], "a key the candidate added is still in the kernel's keyrings"
    deadline = time.monotonic() + 2.0  # the kernel tears a pid namespace down asynchronously
    while leftover_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leftover_processes() == [], "sandbox processes survived the run"
    for path in ESCAPES:
        assert not os.path.exists(path), f"the candidate wrote {path} outside its scratch dir"


def test_correct_program_passes_and_is_timed():
    v = sandbox.run_program("def solve(n):\n    return 3 * n\n", TESTS, EXPECTED, LIMITS, TIMING, TIMING_EXPECTED)
    assert v.status == "correct" and v.runtime is not None and v.runtime > 0


def test_syntax_errors_and_missing_programs():
    assert judge("def solve(n) return 3 * n\n")[0].status == "compile_error"
    assert judge("def solve(n):\n\treturn 1\n        return 2\n")[0].status == "compile_error"
    assert judge("def solve(n):\n    return 3 * n\x00\n")[0].status == "compile_error"
    assert judge("")[0].status == "no_program"
    assert judge(None)[0].status == "no_program"
    assert judge("def other(n):\n    return 3 * n\n")[0].status == "runtime_error"  # no entry point


def test_wrong_output_and_type_strictness():
    assert judge("def solve(n):\n    return 3 * n + 1\n")[0].status == "wrong_output"
    assert judge("def solve(n):\n    return 3.0 * n\n")[0].status == "wrong_output"  # 3.0 is not 3
    assert judge("def solve(n):\n    return [3 * n]\n")[0].status == "wrong_output"


def test_infinite_loop_times_out_within_the_limit():
    for src in ("def solve(n):\n    while True:\n        pass\n", "while True:\n    pass\n"):
        v, took = judge(src)
        assert v.status == "timeout"
        assert took < LIMITS.call_s + 5.0


def test_cpu_time_limit_kills_a_busy_program():
    limits = sandbox.Limits(call_s=30.0, run_s=30.0, cpu_s=1, mode=MODE, label=LABEL)
    v, _ = judge("def solve(n):\n    while True:\n        pass\n", limits)
    # the CPU limit ended it, not the 30 s wall-clock limits (how long 1 CPU second takes depends on the load)
    assert v.status == "timeout" and v.message.startswith("CPU time limit"), v.message


def test_fork_bomb_is_contained_and_reaped():
    src = f"""
import os, subprocess
def solve(n):
    try:
        subprocess.Popen(["sleep", "{SLEEP_ARG}"])
    except OSError:
        pass
    while True:
        try:
            if os.fork() == 0:
                os.setsid()  # try to escape the process group
        except OSError:
            pass
"""
    v, took = judge(src)
    assert v.status == "timeout" and took < LIMITS.call_s + 5.0


def test_memory_bomb_hits_the_memory_limit():
    limits = dataclasses.replace(LIMITS, call_s=10.0, run_s=10.0)  # memory, not time, must stop these
    assert judge("def solve(n):\n    return len(bytearray(2 ** 34))\n", limits)[0].status == "memory_limit"
    grow = "def solve(n):\n    xs = []\n    while True:\n        xs.append(b'x' * (5 * 10 ** 7))\n"
    v, took = judge(grow, limits)
    assert v.status == "memory_limit" and took < limits.call_s + 5.0
    assert judge("blob = bytearray(2 ** 34)\ndef solve(n):\n    return 3 * n\n", limits)[0].status == "memory_limit"


def test_writes_outside_the_scratch_dir_leave_nothing():
    if not namespaced() and os.geteuid() != 0:
        pytest.skip("process mode without root: /tmp is shared with the candidate (see sandbox docstring)")
    src = f"""
import os
def solve(n):
    for path in {ESCAPES!r}:
        try:
            with open(path, "w") as f:
                f.write("escaped")
            print("wrote", path)
        except OSError as e:
            print("blocked", path, type(e).__name__)
    with open("in-scratch.txt", "w") as f:
        f.write("ok")
    print("scratch ok", os.getcwd())
    return 3 * n
"""
    if not namespaced():  # a fresh uid can still write the world-writable dirs
        src = src.replace(repr(ESCAPES), repr(ESCAPES[len(WORLD_WRITABLE):]))
    v, _ = judge(src)
    assert v.status == "correct" and "scratch ok" in v.stdout


def test_nothing_outside_the_private_scratch_folders_is_writable():
    """Every folder the candidate can reach (to depth 3, and the usual world-writable ones: /run/lock kept a cache
    from one judging to the next, and on the host, before the mounts were made read-only)."""
    if not namespaced():
        pytest.skip("process mode has no mount namespace (see sandbox docstring)")
    src = """
import os
def solve(n):
    found, stack = [], [("/", 0)]
    while stack:
        path, depth = stack.pop()
        if path.startswith(("/proc", "/sys/kernel")):
            continue
        if os.access(path, os.W_OK) and not path.startswith(("/tmp", "/var/tmp", "/dev/shm")):
            found.append(path)
        if depth < 3:
            try:
                stack += [(e.path, depth + 1) for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
            except OSError:
                pass
    for path in ("/run/lock", "/var/lock", "/var/crash", "/var/mail", "/dev/mqueue", "/run/user", "/var/spool"):
        if os.path.isdir(path) and os.access(path, os.W_OK):
            found.append(path)
    print("WRITABLE", found)
    return 3 * n
"""
    limits = dataclasses.replace(LIMITS, call_s=10.0, run_s=30.0)
    v = sandbox.run_program(src, [(1,)], [3], limits)
    assert v.status == "correct" and "WRITABLE []" in v.stdout, v.stdout[:2000]


def test_no_network():
    if not namespaced():
        pytest.skip("process mode has no network namespace (see sandbox docstring)")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    src = f"""
import socket
def solve(n):
    for host, port in (("127.0.0.1", {port}), ("1.1.1.1", 80), ("8.8.8.8", 53)):
        try:
            s = socket.create_connection((host, port), timeout=0.3)
            print("CONNECTED", host)
            s.close()
        except OSError as e:
            print("refused", host, type(e).__name__)
    return 3 * n
"""
    try:
        v, _ = judge(src)
        assert v.status == "correct" and "refused 127.0.0.1" in v.stdout and "CONNECTED" not in v.stdout
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()


def test_trainer_environment_is_not_visible(monkeypatch):
    secret = f"tp-secret-{TOKEN}"
    monkeypatch.setenv("TINYPOST_TEST_SECRET", secret)
    src = f"""
import os
def solve(n):
    print(dict(os.environ))
    for pid in ["self", "1", "{os.getpid()}", "{os.getppid()}"] + os.listdir("/proc"):
        try:
            with open("/proc/" + pid + "/environ", "rb") as f:
                print(f.read().decode(errors="replace"))
        except OSError:
            pass
    print("scanned")
    return 3 * n
"""
    v, _ = judge(src)
    assert v.status == "correct" and "scanned" in v.stdout
    assert secret not in v.stdout and "TINYPOST_TEST_SECRET" not in v.stdout


def test_killing_the_parent_fails_and_the_trainer_survives():
    bystander = subprocess.Popen(["sleep", "30"])  # a process of the trainer's user the candidate must not reach
    try:
        src = f"""
import os, signal
def solve(n):
    for pid in ({os.getpid()}, {bystander.pid}, os.getppid()):
        try:
            os.kill(pid, signal.SIGKILL)
            print("killed", pid)
        except OSError as e:
            print("denied", pid, type(e).__name__)
    return 3 * n
"""
        v, _ = judge(src)
        assert v.status == "correct" and "killed" not in v.stdout.replace("killed 0", "")
        # kill everything it may signal, then its own group: at most the sandbox dies (an unconfined child of
        # the same uid as the trainer would take the trainer with it, hence the guard)
        if namespaced() or os.geteuid() == 0:
            v, _ = judge("import os, signal\ndef solve(n):\n    os.kill(-1, signal.SIGKILL)\n    return 3 * n\n")
            assert v.status in ("correct", "runtime_error")
        v, _ = judge("import os, signal\ndef solve(n):\n    os.killpg(0, signal.SIGKILL)\n    return 3 * n\n")
        assert v.status in ("correct", "runtime_error")  # a namespace's init ignores it; else it dies
        assert bystander.poll() is None, "the candidate killed a process outside the sandbox"
    finally:
        bystander.kill()
        bystander.wait()


def test_patching_time_does_not_change_the_measured_runtime():
    src = """
import time
_sleep = time.sleep
for name in ("time", "perf_counter", "monotonic", "process_time", "perf_counter_ns", "monotonic_ns", "time_ns"):
    setattr(time, name, lambda *a: 0)
time.sleep = lambda s: None
def solve(n):
    if n > 1000:
        _sleep(0.05)
    return 3 * n
"""
    v = sandbox.run_program(src, TESTS, EXPECTED, LIMITS, TIMING, TIMING_EXPECTED, clock="wall")
    assert v.status == "correct" and v.runtime >= 0.05
    # the cpu clock is the kernel's account of the process, read by the judge: patching it in the child changes
    # nothing either (the same work with and without the patch, timed in the same rounds)
    work = "def solve(n):\n    t = 0\n    for i in range(5 * n):\n        t += 3\n    return t // 5\n"
    patched = src.split("def solve")[0] + work
    plain, cheat = sandbox.measure([work, patched], TESTS, EXPECTED, TIMING, TIMING_EXPECTED, LIMITS, repeats=3)
    clock = "cpu" if namespaced() else "wall"  # process mode: the network is in reach, so wall time only
    assert plain.clock == cheat.clock == clock and cheat.runtime > 0.5 * plain.runtime > 0


def test_cpu_clock_counts_the_programs_work_not_its_waiting():
    if not namespaced():
        pytest.skip("process mode times by wall clock (see sandbox.timed_call)")
    sleeper = "import time\ndef solve(n):\n    time.sleep(0.05)\n    return 3 * n\n"
    worker = "def solve(n):\n    t = 0\n    for i in range(5 * n):\n        t += 3\n    return t // 5\n"
    sleep, work = sandbox.measure([sleeper, worker], TESTS, EXPECTED, TIMING, TIMING_EXPECTED, LIMITS, repeats=3)
    assert sleep.clock == work.clock == "cpu" and len(sleep.times) == len(sleep.wall_times) == 3
    assert min(sleep.wall_times) >= 0.05 and max(sleep.times) < 0.5 * min(sleep.wall_times)  # asleep: not work
    assert work.runtime == min(work.times) > 0 and all(c <= w for c, w in zip(work.times, work.wall_times))


def test_a_program_cannot_start_a_second_process_or_thread():
    """The issue-36 escape: a child whose CPU time reaches no parent (SIGCHLD ignored, so the kernel reaps it) does
    the work while the timed process blocks on a pipe; it was credited 48.7x. No second task can start now."""
    if not namespaced() and os.geteuid() != 0:
        pytest.skip("process mode without root: RLIMIT_NPROC counts the trainer's own processes")
    reaped_helper = """
import os, signal
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
def solve(n):
    r, w = os.pipe()
    if os.fork() == 0:
        os.write(w, str(3 * n).encode())
        os._exit(0)
    os.close(w)
    return int(os.read(r, 100))
"""
    thread = "import threading\nthreading.Thread(target=print).start()\ndef solve(n):\n    return 3 * n\n"
    spawn = "import subprocess\ndef solve(n):\n    return int(subprocess.check_output(['echo', str(3 * n)]))\n"
    for src in (reaped_helper, thread, spawn):
        v = sandbox.measure([src], TESTS, EXPECTED, TIMING, TIMING_EXPECTED, LIMITS, repeats=3)[0]
        assert v.status == "runtime_error" and not v.times, (v.status, v.message)


def test_where_helpers_can_start_a_program_with_them_is_timed_by_wall_clock():
    # a helper could work while the main thread waits: the cpu count of one process would not see that work
    thread = "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n" \
             "def solve(n):\n    return 3 * n\n"
    # the helpers' work is counted in clock ticks (10 ms) once they are gone: 10 n steps (~0.1 s a call) stays
    # clear of that grain on a fast CPU (n steps, a few ms, was missed on one: the program was timed by cpu)
    child = "import os\ndef solve(n):\n    pid = os.fork()\n    if pid == 0:\n        s = 0\n" \
            "        for i in range(10 * n):\n            s += i\n        os._exit(0)\n    os.waitpid(pid, 0)\n" \
            "    return 3 * n\n"
    joined = "import threading\ndef work(n):\n    s = 0\n    for i in range(10 * n):\n        s += i\n" \
             "def solve(n):\n    t = threading.Thread(target=work, args=(n,))\n    t.start()\n    t.join()\n" \
             "    return 3 * n\n"  # the thread is gone when the call returns; its CPU time is not
    alone = "def solve(n):\n    return 3 * n\n"
    verdicts = sandbox.measure([thread, child, joined, alone], TESTS, EXPECTED, TIMING, TIMING_EXPECTED,
                               THREADS_ALLOWED, repeats=3)
    for name, v, clock in zip(("thread", "child", "joined", "alone"), verdicts,
                              ("wall", "wall", "wall", "cpu" if namespaced() else "wall")):
        assert v.status == "correct" and v.clock == clock and len(v.times) == 3, (name, v.status, v.clock, v.times)
        if clock == "wall":
            assert v.times == v.wall_times


def test_the_programs_of_a_timing_round_share_one_cpu():
    src = "import os\ndef solve(n):\n    print(n, sorted(os.sched_getaffinity(0)))\n    return 3 * n\n"
    a, b = sandbox.measure([src, src + "# a copy\n"], TESTS, EXPECTED, TIMING, TIMING_EXPECTED, LIMITS, repeats=3)
    seen = [dict(line.split(" ", 1) for line in v.stdout.splitlines()) for v in (a, b)]
    for args in TIMING:  # the warm-up and the 3 rounds, one input each
        n = str(args[0])
        assert seen[0][n] == seen[1][n] and len(json.loads(seen[0][n])) == 1, (n, seen)


def test_tampering_with_equality_or_the_reply_channel_is_caught():
    always_equal = "class Eq(int):\n    def __eq__(self, o):\n        return True\ndef solve(n):\n    return Eq(0)\n"
    assert judge(always_equal)[0].status == "wrong_output"
    not_data = "class Eq:\n    def __eq__(self, o):\n        return True\ndef solve(n):\n    return Eq()\n"
    assert judge(not_data)[0].status in ("wrong_output", "runtime_error")
    forge = """
import json, os, struct, sys
wfd = json.loads(sys.argv[1])["wfd"]
def frame(obj):
    data = json.dumps(obj).encode()
    os.write(wfd, struct.pack("<I", len(data)) + data)
def solve(n):
    frame({"status": "correct"})
    frame({"status": "ok", "value": 0})
    return 0
"""
    assert judge(forge)[0].status in ("wrong_output", "runtime_error")
    patch_runner = """
import json, __main__
__main__.json = type("J", (), {"dumps": staticmethod(lambda o: '{"status": "ok", "value": 3}')})
def solve(n):
    return 0
"""
    assert judge(patch_runner)[0].status == "wrong_output"
    ahead = """
import json, os, struct, sys
wfd = json.loads(sys.argv[1])["wfd"]
def solve(n):
    data = json.dumps({"status": "ok", "value": 3 * (n + 1)}).encode()  # a guess at the next call's answer
    os.write(wfd, struct.pack("<I", len(data)) + data)
    return 3 * n
"""
    assert judge(ahead)[0].status in ("wrong_output", "runtime_error")
    p, first = sandbox.start(ahead, LIMITS)
    try:  # replies queued ahead of a call: the call fails instead of taking them as its answer in no time
        assert first["status"] == "ready" and sandbox.call(p, (1,), LIMITS)[0]["value"] == 6
        select.select([p.rfd], [], [], 30.0)  # the genuine reply, still on its way: no race with the child
        reply, _ = sandbox.call(p, (2,), LIMITS)
        assert reply["status"] == "runtime_error" and "out of turn" in reply["msg"], reply
    finally:
        sandbox.kill(p)
    garbage = "import json, os, sys\nwfd = json.loads(sys.argv[1])['wfd']\n" \
              "def solve(n):\n    os.write(wfd, b'\\xff\\xff\\xff\\x7f' + b'x' * 100)\n    return 3 * n\n"
    assert judge(garbage)[0].status == "wrong_output"


def test_exiting_early_with_status_zero_is_not_success():
    for src in ("import sys\nsys.exit(0)\n", "import os\ndef solve(n):\n    os._exit(0)\n",
                "def solve(n):\n    raise SystemExit(0)\n",
                "import os\nos.close(0)\ndef solve(n):\n    return 3 * n\n",
                "import os\nos.write(2, b'sandbox setup: fake\\n')\nos._exit(97)\n"):  # posing as a setup failure
        assert judge(src)[0].status == "runtime_error", src


def test_huge_output_is_capped_and_does_not_block():
    src = "import sys\ndef solve(n):\n    sys.stdout.write('x' * 20_000_000)\n    sys.stderr.write('y' * 5_000_000)\n" \
          "    sys.stdout.flush()\n    return 3 * n\n"
    v, _ = judge(src)
    assert v.status == "correct" and len(v.stdout) <= LIMITS.output_bytes and len(v.stderr) <= LIMITS.output_bytes
    v, took = judge("import os\ndef solve(n):\n    while True:\n        os.write(1, b'z' * 65536)\n")
    assert v.status == "timeout" and took < LIMITS.call_s + 5.0


def test_deep_recursion_is_a_runtime_error():
    assert judge("def solve(n):\n    return solve(n + 1)\n")[0].status == "runtime_error"
    unbounded = "import sys\nsys.setrecursionlimit(10 ** 9)\ndef solve(n):\n    return solve(n + 1)\n"
    v, took = judge(unbounded)  # Python frames live on the heap: it runs until a limit stops it
    assert v.status in ("memory_limit", "timeout") and took < LIMITS.call_s + 5.0
    c_stack = "import sys\nsys.setrecursionlimit(10 ** 9)\n" \
              "class A:\n    def __repr__(self):\n        return repr(self)\n" \
              "def solve(n):\n    return repr(A())\n"
    assert judge(c_stack)[0].status == "runtime_error"  # the C stack overflows: SIGSEGV


def test_answers_cached_across_calls_or_runs_never_hit():
    if not namespaced():
        pytest.skip("process mode shares /tmp between runs (see sandbox docstring)")
    src = """
import json, os
CACHE = {}
def solve(n):
    for path in ("/tmp/tp-cache.json", "/dev/shm/tp-cache.json", "tp-cache.json"):
        if os.path.exists(path):
            with open(path) as f:
                if str(n) in json.load(f):
                    print("HIT file", path)
    if n in CACHE:
        print("HIT memory", n)
        return CACHE[n]
    t = 0
    for i in range(n):
        t += 3
    CACHE[n] = t
    for path in ("/tmp/tp-cache.json", "/dev/shm/tp-cache.json", "tp-cache.json"):
        with open(path, "w") as f:
            json.dump(CACHE, f)
    return t
"""
    for _ in range(2):  # two runs: nothing survives from the first
        v = sandbox.measure([src], TESTS, EXPECTED, TIMING, TIMING_EXPECTED, LIMITS, repeats=3)[0]
        assert v.status == "correct" and len(v.times) == 3 and "HIT" not in v.stdout
    with pytest.raises(ValueError, match="need 5 timing inputs"):  # a round would repeat an input: a memo would hit
        sandbox.measure([src], TESTS, EXPECTED, TIMING, TIMING_EXPECTED, LIMITS, repeats=4)


def test_the_kernel_keyring_keeps_nothing_from_one_judging_to_the_next():
    """Keys are global kernel objects (their serials are listed in /proc/keys in every namespace) and a fresh uid's
    user keyring lives until reboot: a key one judging links there, readable by all, was read by the next."""
    writer = KEYCTL_LIB + f"""
def solve(n):
    for name, ring in KEYRINGS.items():
        serial = sys_call(NR["add_key"], b"user", b"tp-key-{TOKEN}-" + name.encode(), b"answer", 6, ring)
        # readable by every uid (KEYCTL_SETPERM), and linked into the user keyring (KEYCTL_LINK), which outlives us
        print("add", name, serial, keyctl(5, serial, 0x3f3f3f3f), keyctl(8, serial, -4))
    return 3 * n
"""
    reader = KEYCTL_LIB + f"""
def solve(n):
    with open("/proc/keys") as f:
        for line in f:
            if "tp-key-{TOKEN}" in line:
                buf = ctypes.create_string_buffer(64)
                print("FOUND", line.strip(), keyctl(11, int(line.split()[0], 16), buf, 64), buf.value)  # KEYCTL_READ
    for name, ring in KEYRINGS.items():
        for desc in (b"tp-key-{TOKEN}-" + n.encode() for n in KEYRINGS):
            for found in (keyctl(10, ring, b"user", desc, 0), sys_call(NR["request_key"], b"user", desc, None, 0)):
                if found > 0:
                    print("FOUND", name, desc, found)
    print("searched")
    return 3 * n
"""
    try:
        first, _ = judge(writer)
        second, _ = judge(reader)
        assert first.status == "correct" and second.status == "correct", (first.message, second.message)
        assert "searched" in second.stdout and "FOUND" not in second.stdout, (first.stdout, second.stdout)
    finally:
        invalidate(token_keys())


def test_keyring_and_ipc_calls_fail_inside_the_sandbox():
    """Denied in every isolation mode (a seccomp filter): the keyring calls, SysV IPC and POSIX message queues (their
    state outlives the process, and only the namespace modes have a private IPC namespace), unix sockets (they reach
    the host's services by path, and in "process" mode its abstract ones) and io_uring (which could open them)."""
    src = KEYCTL_LIB + """
def solve(n):
    IPC_PRIVATE, IPC_CREAT = 0, 0o1000
    calls = {"add_key": sys_call(NR["add_key"], b"user", b"tp-key", b"answer", 6, KEYRINGS["session"]),
             "request_key": sys_call(NR["request_key"], b"user", b"tp-key", None, 0),
             "keyctl": keyctl(0, KEYRINGS["user"], 1),  # KEYCTL_GET_KEYRING_ID, creating the user keyring
             "join_session": keyctl(1, None),  # KEYCTL_JOIN_SESSION_KEYRING: a new anonymous one
             "shmget": sys_call(NR["shmget"], IPC_PRIVATE, 4096, IPC_CREAT | 0o600),
             "msgget": sys_call(NR["msgget"], IPC_PRIVATE, IPC_CREAT | 0o600),
             "semget": sys_call(NR["semget"], IPC_PRIVATE, 1, IPC_CREAT | 0o600),
             "mq_open": sys_call(NR["mq_open"], b"tp-mq", os.O_CREAT | os.O_RDWR, 0o600, None),
             "socket_unix": sys_call(NR["socket"], 1, 1, 0),  # AF_UNIX, SOCK_STREAM
             "socket_unix_high_bits": sys_call(NR["socket"], (1 << 32) | 1, 1, 0),  # the kernel reads an int
             "io_uring_setup": sys_call(NR["io_uring_setup"], 1, ctypes.create_string_buffer(120))}
    if os.uname().machine == "x86_64":  # the x32 ABI's add_key (bit 30 set): a filter must not let it through
        calls["x32_add_key"] = sys_call(0x40000000 | NR["add_key"], b"user", b"tp-key", b"answer", 6, -3)
    print(json.dumps(calls))
    return 3 * n
"""
    p, first = sandbox.start(src, LIMITS)
    try:
        assert first["status"] == "ready", first
        reply, _ = sandbox.call(p, (1,), LIMITS)
        assert reply.get("value") == 3, reply
    finally:
        sandbox.kill(p)
    calls = json.loads(p.out["stdout"].decode().strip().splitlines()[-1])
    want = {name: -errno.EPERM for name in calls}
    if "x32_add_key" in calls:
        want["x32_add_key"] = -errno.ENOSYS
    assert calls == want
    if os.geteuid() == 0:  # a fresh uid: the kernel keeps no keyring quota for it (it did, until reboot)
        with open("/proc/key-users") as f:
            assert str(p.uid) not in [line.split(":")[0].strip() for line in f]
    # everything else still works: an AF_INET socket, a pipe, a file in the scratch folder
    ok = "import os, socket\ndef solve(n):\n    socket.socket().close()\n    os.pipe()\n" \
         "    open('f', 'w').close()\n    return 3 * n\n"
    assert judge(ok)[0].status == "correct"


def test_embedded_tasks_slow_and_fast_references_differ_far_beyond_noise():
    for task in code_tasks.TASKS.values():
        r = code_tasks.judge(task, [], repeats=3)
        # load on the machine only adds time, so the fastest of the repeats is the least noisy figure
        slow, fast = min(r["slow"].times), min(r["fast"].times)
        assert slow > 5 * fast, (task.name, r["slow"].times, r["fast"].times)


def test_embedded_broken_programs_fail_and_sum_range_is_sum_of_range():
    task = code_tasks.TASKS["sum_range"]
    tests_out, _ = code_tasks.expected_outputs(task)
    assert tests_out == [sum(range(a[0])) for a in task.tests]
    for task in code_tasks.TASKS.values():
        verdicts = code_tasks.judge(task, list(task.broken), repeats=0)["verdicts"]
        assert all(v.status != "correct" for v in verdicts), task.name


def test_task_file_errors_are_one_line(tmp_path):
    good = dict(name="t", statement="s", signature="def solve(n)", tests=[[1]], timing=[[1], [2]],
                slow="def solve(n):\n return n\n", fast="def solve(n):\n return n\n")
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(good) + "\n")
    assert list(code_tasks.load_tasks(str(path))) == ["t"]
    for text, words in (("{not json\n", "not valid JSON"),
                        (json.dumps({k: v for k, v in good.items() if k != "fast"}), "missing field 'fast'"),
                        (json.dumps({**good, "timing": [[1]]}), "at least 2"),
                        (json.dumps({**good, "tests": 3}), "should be a list")):
        path.write_text(text + "\n")
        with pytest.raises(SystemExit, match=words) as e:
            code_tasks.load_tasks(str(path))
        assert str(e.value).startswith("error: ") and "\n" not in str(e.value)
    with pytest.raises(SystemExit, match="does not exist"):
        code_tasks.load_tasks(str(tmp_path / "missing.jsonl"))
