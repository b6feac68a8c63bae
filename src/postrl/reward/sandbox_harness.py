"""Runs inside the code sandbox: sets up the jail, then runs a program against its tests.

Started by :mod:`postrl.reward.sandbox` as ``python -I [-S] sandbox_harness.py RESULT_FD [REQUEST_FD]`` (inside
fresh network/PID/mount namespaces when the kernel allows) with a ``marshal``-encoded spec on
stdin (written by the trusted parent, never by the program). In order:
a private tmpfs on /tmp (mount namespace only), a fresh working directory, stdin closed, resource
limits, privileges dropped to an unprivileged user (when started as root), every other file
descriptor closed. Then, per test, one line ``index<TAB>1|0<TAB>error`` is written to RESULT_FD as soon as that test ends, so a later hang does not lose earlier results.

Assert tests run in the program's own interpreter after the program. Stdin/stdout tests run the
program once per case in a forked child (own process group) whose output this process reads and
compares, so the program cannot write its own verdict for those.

Standard library only, and only modules that import fast (no json, signal or enum: ~20 ms of a
~30 ms run): this file runs with ``-I`` (no user site, no PYTHONPATH) and often ``-S``. The spec
arrives as ``marshal`` data from the trusted parent; verdicts go back as tab-separated lines that
the parent parses as text (nothing the program could write is ever unmarshalled).
"""

import io
import marshal
import os
import resource
import select
import sys
import time

CHILD_OUTPUT_CAP = 1 << 20
EX_TEMPFAIL = 75  # sandbox.py: io cases could not start (a fork refused until the case's deadline)


SIGKILL = 9


def _libc():
    import ctypes

    return ctypes, ctypes.CDLL(None, use_errno=True)


def _mount_private_tmp(size_mb):
    ctypes, libc = _libc()
    for target in (b"/tmp", b"/dev/shm", b"/var/tmp"):
        if os.path.isdir(target):
            opts = b"size=%dm,mode=1777" % size_mb
            if libc.mount(b"tmpfs", target, b"tmpfs", 0, opts) != 0 and target == b"/tmp":
                raise OSError(ctypes.get_errno(), "mount tmpfs on /tmp failed")


MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC = 1, 32, 4096, 16384


def _world_traversable(path):
    while True:
        if not os.stat(path).st_mode & 0o001:
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return True
        path = parent


def _expose_stdlib():
    """Bind the standard library read-only under /tmp when the sandbox user could not reach it.

    (An interpreter installed under /root, e.g. by pyenv, is unreadable once privileges drop.)
    """
    libdir = os.path.dirname(os.__file__)
    if _world_traversable(libdir):
        return
    ctypes, libc = _libc()
    target = "/tmp/.stdlib"
    os.mkdir(target, 0o755)
    if libc.mount(libdir.encode(), target.encode(), None, MS_BIND | MS_REC, None) != 0:
        raise OSError(ctypes.get_errno(), "bind mount of the standard library failed")
    libc.mount(None, target.encode(), None, MS_BIND | MS_REMOUNT | MS_RDONLY, None)
    sys.path[:] = [p.replace(libdir, target, 1) if p.startswith(libdir) else p for p in sys.path]
    for module in list(sys.modules.values()):
        paths = getattr(module, "__path__", None)
        if isinstance(paths, list):
            paths[:] = [p.replace(libdir, target, 1) if p.startswith(libdir) else p for p in paths]
    sys.path_importer_cache.clear()


def _limit(kind, value, headroom=0):
    soft, hard = resource.getrlimit(kind)
    if hard != resource.RLIM_INFINITY and value + headroom > hard:
        value, headroom = hard, 0
    resource.setrlimit(kind, (value, value + headroom))


def _jail(spec):
    if spec["private_tmp"]:
        _mount_private_tmp(spec["tmp_size_mb"])
        if spec["uid"] is not None:
            _expose_stdlib()
        workdir = "/tmp/work"
        os.mkdir(workdir, 0o700)
    else:
        workdir = spec["workdir"]
    uid, gid = spec["uid"], spec["gid"]
    if uid is not None:
        os.chown(workdir, uid, gid)
    os.chdir(workdir)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    limits = spec["limits"]
    _limit(resource.RLIMIT_CPU, limits["cpu_s"], headroom=1)  # SIGXCPU (a named reason) before SIGKILL
    _limit(resource.RLIMIT_AS, limits["memory_mb"] << 20)
    _limit(resource.RLIMIT_FSIZE, limits["file_size_mb"] << 20)
    _limit(resource.RLIMIT_NOFILE, limits["open_files"])
    _limit(resource.RLIMIT_CORE, 0)
    if uid is not None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    _limit(resource.RLIMIT_NPROC, limits["processes"])  # after setuid: counted against the sandbox user


def _report(fd, index, passed, error=None):
    text = (error or "").replace("\t", " ").replace("\n", " ")
    os.write(fd, ("%d\t%d\t%s\n" % (index, 1 if passed else 0, text)).encode("utf-8", "replace"))


def _describe(exc):
    text = str(exc)
    return type(exc).__name__ + (": " + text[:300] if text else "")


def run_asserts(spec, fd):
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    sys.stdin = io.TextIOWrapper(io.BytesIO(b""))
    try:
        exec(compile(spec["program"], "<program>", "exec"), scope)
    except SystemExit:
        pass
    except BaseException as exc:  # noqa: BLE001 - any failure of the program fails every test
        for i in range(len(spec["tests"])):
            _report(fd, i, False, "program raised " + _describe(exc))
        return
    for i, test in enumerate(spec["tests"]):
        try:
            exec(compile(test, "<test %d>" % i, "exec"), scope)
        except BaseException as exc:  # noqa: BLE001 - a failed assert, an error or an exit all fail the test
            _report(fd, i, False, _describe(exc) or "AssertionError")
        else:
            _report(fd, i, True)


def _read_exact(fd, n):
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _run_cell(code, scope):
    """Run one cell like a REPL: statements, then the value of a last bare expression printed."""
    import ast

    tree = ast.parse(code, "<cell>", "exec")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<cell>", "exec"), scope)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), scope)
        if value is not None:
            print(repr(value))


def run_session(spec, fd, request_fd):
    """A stateful interpreter: cells arrive on REQUEST_FD as ``length\n`` + UTF-8 code; each reply
    on RESULT_FD is ``ok|error<TAB>length\n`` + the cell's output (text the parent never unmarshals)."""
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    sys.stdin = io.TextIOWrapper(io.BytesIO(b""))
    cap = spec["output_bytes"]
    while True:
        line = b""
        while not line.endswith(b"\n"):
            chunk = os.read(request_fd, 1)
            if not chunk:
                return
            line += chunk
        code = _read_exact(request_fd, int(line))
        if code is None:
            return
        out = io.StringIO()
        sys.stdout = sys.stderr = out
        status = "ok"
        try:
            _run_cell(code.decode("utf-8", "replace"), scope)
        except SystemExit:
            pass
        except BaseException as exc:  # noqa: BLE001 - the cell's failure is its output
            out.write(_describe(exc) + "\n")
            status = "error"
        finally:
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        data = out.getvalue().encode("utf-8", "replace")[:cap]
        os.write(fd, ("%s\t%d\n" % (status, len(data))).encode() + data)


def _child(program, stdin_path, out_fd, result_fd):
    os.setpgid(0, 0)
    os.close(result_fd)
    fd = os.open(stdin_path, os.O_RDONLY)
    os.dup2(fd, 0)
    os.dup2(out_fd, 1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "rb", closefd=False))
    sys.stdout = sys.stderr = io.TextIOWrapper(io.FileIO(1, "wb", closefd=False), write_through=True)
    code = 0
    try:
        exec(compile(program, "<program>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - a crash is a failed case
        code = 1
    try:
        sys.stdout.flush()
    finally:
        os._exit(code)


def _normalise(text):
    return [line.rstrip() for line in text.strip().splitlines()]


def _fork_within(deadline):
    """``os.fork()``, tried again until ``deadline`` while the kernel refuses it (EAGAIN): the
    process limit counts every process of the sandbox user, so another sample's program (a fork
    bomb, until its wall-clock limit kills it) can hold it for a while. None: refused throughout."""
    while True:
        try:
            return os.fork()
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)


def run_io(spec, fd):
    for i, case in enumerate(spec["tests"]):
        stdin_path = "stdin_%d.txt" % i
        with open(stdin_path, "w") as f:
            f.write(case["input"])
        deadline = time.monotonic() + spec["case_timeout_s"]
        r, w = os.pipe()
        pid = _fork_within(deadline)
        if pid is None:  # not the program's doing: the parent makes the sample unscorable
            _report(fd, i, False, "could not start the case: the sandbox user's process limit stayed reached")
            os._exit(EX_TEMPFAIL)
        if pid == 0:
            os.close(r)
            _child(spec["program"], stdin_path, w, fd)
        os.close(w)
        out, error = bytearray(), None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                error = "timed out after %gs" % spec["case_timeout_s"]
                break
            ready, _, _ = select.select([r], [], [], left)
            if not ready:
                continue
            chunk = os.read(r, 65536)
            if not chunk:
                break
            out += chunk
            if len(out) > CHILD_OUTPUT_CAP:
                error = "output over %d bytes" % CHILD_OUTPUT_CAP
                break
        os.close(r)
        try:
            os.killpg(pid, SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        _, status = os.waitpid(pid, 0)
        if error is None and os.waitstatus_to_exitcode(status) != 0:
            error = "exit status %d" % os.waitstatus_to_exitcode(status)
        if error is None:
            got = _normalise(out.decode("utf-8", "replace"))
            want = _normalise(case["output"])
            if got != want:
                error = "wrong output"
        _report(fd, i, error is None, error)


def _stay_init_if_pid_1():
    """In a new PID namespace this process is PID 1, which the kernel shields from signals it has
    no handler for (so CPU-limit and self-sent signals would not end it). Fork: the child runs the
    tests; this process only reaps and exits with the child's status (128+N for signal N), and its
    exit takes every process left in the namespace with it."""
    if os.getpid() != 1:
        return
    child = os.fork()
    if child == 0:
        return
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(1)
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            os._exit(128 - code if code < 0 else code)


def main():
    _stay_init_if_pid_1()
    fd = int(sys.argv[1])
    request_fd = int(sys.argv[2]) if len(sys.argv) > 2 else None
    spec = marshal.loads(sys.stdin.buffer.read())
    _jail(spec)
    kept = sorted({fd} | ({request_fd} if request_fd is not None else set()))
    low = 3
    for keep in kept:
        os.closerange(low, keep)
        low = keep + 1
    os.closerange(low, 4096)
    if spec["mode"] == "session":
        run_session(spec, fd, request_fd)
    else:
        (run_io if spec["mode"] == "io" else run_asserts)(spec, fd)
    os._exit(0)


if __name__ == "__main__":
    main()
