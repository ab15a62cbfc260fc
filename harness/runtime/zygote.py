"""Workers forked from a parent that has imported torch, transformers, peft and DeepSpeed once (a zygote).

A tiny case run is a few seconds of training behind 4-7 s of CPU spent importing the training stack
in a fresh interpreter; the CPU tier starts dozens of workers. The zygote is one process per harness
that imports the stack (`PRELOAD`) and then forks a child per job: the child is still one fresh
process per case run (nothing of an earlier run is in it: the zygote never builds a model, never
runs an operator and never touches a GPU), only its imports are already done.

Used on CPU hosts only (`harness.runtime.launcher` decides): a process that has initialised CUDA or
HIP cannot be forked safely, and a GPU run's context costs more than its imports anyway. Multi-rank
runs go through torchrun as before.

A case whose workers run on another environment's interpreter (LLaMA-Factory's, `harness.runtime.stacks`)
gets a zygote of that interpreter (`shared(python)`), which has imported that environment's stack: a
zygote only forks workers of the interpreter it runs on.

A child gets what `subprocess.Popen(..., start_new_session=True)` gives a worker: a session and
process group of its own (a timeout kills its whole tree), stdout and stderr on the case's log (the
launcher's own file descriptor, passed over the socket, so lines interleave as they do for a Popen
child), stdin on /dev/null, the job's environment and working directory, and the exit code of
`python -m <module>` (a traceback and 1 for an exception, minus the signal number when killed). It
returns from the server's loop and runs the module as `__main__` at the top level of the
interpreter, so it exits through the interpreter's normal shutdown (atexit handlers, threads
joined, streams flushed) as a fresh `python -m` would.

Why not `multiprocessing`'s forkserver (`set_forkserver_preload`): its children run inside
multiprocessing's process bootstrap, which ends them with `os._exit` after the target (no atexit
handlers: the worker's stack-dump disarm would not run), closes their stdin, and makes them report
as multiprocessing children (`current_process().name`, which transformers' data collator checks);
its preload list is one per harness process, shared with any other forkserver user there; it starts
a resource-tracker process as well; and the exit status comes back only through its Process objects.

If the harness dies, the zygote's socket closes and it exits; its children are workers that exit
with their owner (`harness.runtime.process_tree.exit_with_owner`).

Other harness processes can use a running zygote instead of starting their own (its imports are
6-7 CPU-s): it also listens on a Unix socket in a private folder (`address`), and a harness started
with `SOCKET_ENV` naming it connects there. Each job's exit code goes back to the harness that asked
for it, and each job still gets that harness's environment, folder and log, and exits with it; the
zygote stays the process of the harness that started it, and exits with it.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import psutil

from harness.runtime import stopping

# What a worker imports, heaviest first: each is imported once here instead of in every worker.
# A name that cannot be imported on this host (no bitsandbytes, no Triton for fla) is skipped.
PRELOAD = ("torch", "transformers", "peft", "bitsandbytes", "deepspeed", "fla", "accelerate",
           "harness.runtime.worker", "harness.runtime.build", "harness.runtime.engine", "harness.runtime.train",
           "harness.runtime.measurement", "harness.runtime.probe", "harness.runtime.data",
           "harness.spec.dsconfig", "harness.measure.flops")
ENABLE_ENV = "HARNESS_ZYGOTE"  # "0": every worker in a fresh interpreter
SOCKET_ENV = "HARNESS_ZYGOTE_SOCKET"  # the address of a running zygote to use instead of starting one
PRELOAD_ENV = "HARNESS_ZYGOTE_PRELOAD"  # comma-separated modules instead of PRELOAD
EXIT_LOST = 255  # a job whose exit code was lost with the zygote
_MESSAGE = 1 << 20  # bytes: a job's environment fits many times over


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1") != "0"


# --- the client: the harness's side -------------------------------------------------------------------------


class ZygoteError(RuntimeError):
    """The zygote could not start or stopped answering; the message says what it printed."""


@dataclass
class Child:
    """A job forked by the zygote, waited on like a `subprocess.Popen` (it is the zygote's child,
    not ours: its exit code comes over the socket)."""

    pid: int
    argv: list[str]
    returncode: int | None = None
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode if self._done.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.argv, timeout)
        return self.returncode


class Zygote:
    """One zygote process and the jobs it forked. Start it early (`warm`): its imports run in the
    background, and `start` waits for them only if they have not finished."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD, ready_timeout_s: float = 300, address: str | None = None,
                 python: str = sys.executable):
        """Start a zygote on the interpreter `python`, or with `address` connect to one another harness
        started (OSError if nothing listens there)."""
        self._proc = self._errors = None
        self._folder: str | None = None
        if address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                self._sock.connect(address)
            except OSError:
                self._sock.close()
                raise
        else:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._sock = ours
            self._errors = tempfile.TemporaryFile()  # what the zygote itself prints (import warnings)
            # its socket's folder, made here so that this process removes it however the zygote ends
            # (killed at a stop while it was still importing, or between making it and saying so)
            self._folder = tempfile.mkdtemp(prefix="oom-harness-zygote-")  # 0700: only this user connects
            self._proc = subprocess.Popen(
                [python, "-m", __name__, str(theirs.fileno()), ",".join(preload), self._folder],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=self._errors, stderr=subprocess.STDOUT,
                start_new_session=True)  # a Ctrl-C at the terminal is for the harness, which then stops the jobs
            theirs.close()
        self._lock = threading.Lock()  # the children and early exits
        self._send_lock = threading.Lock()  # one request at a time: the zygote answers them in order
        self._started: list[int] = []
        self._started_cond = threading.Condition()
        self._children: dict[int, Child] = {}
        self._exits: dict[int, int] = {}
        self._ready = threading.Event()
        self._gone = threading.Event()
        self.ready_timeout_s = ready_timeout_s
        self.info: dict = {}
        self._reader = threading.Thread(target=self._read, name="harness-zygote", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else self.info.get("ready")

    def address(self) -> str | None:
        """Where other harness processes reach this zygote (`SOCKET_ENV`), once it is ready."""
        if not self._ready.wait(self.ready_timeout_s) or self._gone.is_set():
            return None
        return self.info.get("socket")

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            msg = json.loads(data)
            if "ready" in msg:
                self.info = msg
                self._ready.set()
            elif "started" in msg:
                with self._started_cond:
                    self._started.append(msg["started"])
                    self._started_cond.notify_all()
            elif "exited" in msg:
                with self._lock:
                    child = self._children.pop(msg["exited"], None)
                    if child is None:  # exited before start() registered it
                        self._exits[msg["exited"]] = msg["code"]
                if child is not None:
                    child._exited(msg["code"])
        self._gone.set()
        self._ready.set()
        with self._started_cond:
            self._started_cond.notify_all()
        threading.Thread(target=self._orphans, name="harness-zygote-orphans", daemon=True).start()

    def _orphans(self) -> None:
        """The zygote is gone: its children's exit codes are lost. Each is over once its process is."""
        with self._lock:
            children, self._children = list(self._children.values()), {}
        for child in children:
            with contextlib.suppress(psutil.Error):
                psutil.Process(child.pid).wait()
            child._exited(EXIT_LOST)

    def _said(self) -> str:
        if self._errors is None:  # another harness's zygote: what it printed is in that harness's file
            return ""
        with contextlib.suppress(OSError):
            self._errors.seek(0)
            lines = self._errors.read().decode(errors="replace").strip().splitlines()
            return " | ".join(lines[-5:])[-1500:]
        return ""

    def start(self, argv: list[str], env: dict[str, str], cwd: str, log_fd: int) -> Child:
        """Fork `python -m <module> <args>` (argv as for Popen: [python, "-m", module, *args]) with this
        environment and working directory, its stdout and stderr on `log_fd`."""
        if len(argv) < 3 or argv[1] != "-m":
            raise ValueError(f"the zygote runs modules (python -m MODULE ...), not {argv[:3]}")
        if not self._ready.wait(self.ready_timeout_s) or self._gone.is_set():
            raise ZygoteError(f"the worker zygote (pid {self.pid}) did not start: {self._said() or 'it said nothing'}")
        request = json.dumps({"module": argv[2], "args": argv[3:], "env": env, "cwd": cwd}).encode()
        with self._send_lock:
            with self._started_cond:
                before = len(self._started)
            try:
                socket.send_fds(self._sock, [request], [log_fd])
            except OSError as exc:
                raise ZygoteError(f"the worker zygote (pid {self.pid}) is gone: {self._said() or exc}") from exc
            with self._started_cond:
                self._started_cond.wait_for(lambda: len(self._started) > before or self._gone.is_set())
                if len(self._started) <= before:
                    raise ZygoteError(f"the worker zygote (pid {self.pid}) stopped: {self._said() or 'no message'}")
                pid = self._started[before]
        child = Child(pid, list(argv))
        with self._lock:
            if pid in self._exits:
                child._exited(self._exits.pop(pid))
            else:
                self._children[pid] = child
        return child

    def close(self) -> None:
        """Stop the zygote, or let go of another harness's (running children are the launcher's to stop)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        if self._proc is None:
            return
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._errors.close()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)


_shared: Zygote | None = None
_others: dict[str, Zygote] = {}  # the zygotes of other environments' interpreters, by their path
_shared_lock = threading.Lock()


def _own(python: str | None) -> bool:
    return python is None or os.path.abspath(python) == os.path.abspath(sys.executable)


def shared(python: str | None = None) -> Zygote:
    """This harness process's zygote for workers on the interpreter `python` (default: this one),
    started on first use (and again if it died): for this interpreter, the one `SOCKET_ENV` names
    where it answers, else one of its own."""
    global _shared
    with _shared_lock:
        if not _own(python):
            key = os.path.abspath(python)
            if key not in _others or _others[key]._gone.is_set():
                names = os.environ.get(PRELOAD_ENV)
                _others[key] = Zygote(tuple(names.split(",")) if names else PRELOAD, python=python)
            return _others[key]
        if _shared is None or _shared._gone.is_set():
            _shared = None
            if os.environ.get(SOCKET_ENV):
                with contextlib.suppress(OSError):
                    _shared = Zygote(address=os.environ[SOCKET_ENV])
            if _shared is None:
                names = os.environ.get(PRELOAD_ENV)
                _shared = Zygote(tuple(names.split(",")) if names else PRELOAD)
        return _shared


def warm() -> None:
    """Start the zygote now, so that its imports overlap other work."""
    shared()


def _zygotes() -> list[Zygote]:
    return [z for z in (_shared, *_others.values()) if z is not None]


def _close_shared() -> None:
    for zygote in _zygotes():
        zygote.close()


def _let_go() -> None:
    """At a stop (harness.runtime.stopping): no job is started any more. The zygote of this process
    is told to exit (it removes its socket's folder on the way), or killed while it is still
    importing (nothing of it is on disk yet: its folder is made after the imports); the interpreter's
    exit then waits for it (`close`). A thread waiting to start a job sees it gone at once."""
    for zygote in _zygotes():
        with contextlib.suppress(OSError):
            zygote._sock.shutdown(socket.SHUT_RDWR)
        if zygote._proc is not None and not zygote._ready.is_set():
            with contextlib.suppress(OSError):
                zygote._proc.kill()


atexit.register(_close_shared)
stopping.on_stop(_let_go)


# --- the server: the zygote process ----------------------------------------------------------------------------


def _preload(names: list[str]) -> tuple[list[str], dict[str, str]]:
    loaded, failed = [], {}
    for name in names:
        try:
            __import__(name)
            loaded.append(name)
        except Exception as exc:  # an optional library missing on this host: its workers import what they need
            failed[name] = f"{type(exc).__name__}: {exc}"[:300]
    with contextlib.suppress(Exception):
        # py-cpuinfo asks the CPU again in a subprocess on every call, three times per DeepSpeed worker
        # (op builders, CPU Adam); the host's CPU does not change while the harness runs
        import functools

        import cpuinfo

        cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)
        cpuinfo.get_cpu_info()
    return loaded, failed


def _serve(owner: socket.socket, listener: socket.socket, ready: dict) -> tuple[dict, int] | None:
    """Fork a child per request, from the harness that started the zygote (`owner`) or one that
    connected to `listener`, until the owner closes its socket. Returns only in a child: its
    request and the log's file descriptor."""
    sig_r, sig_w = os.pipe()
    os.set_blocking(sig_r, False)
    os.set_blocking(sig_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd is written
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.set_wakeup_fd(sig_w)
    selector = selectors.DefaultSelector()
    selector.register(owner, selectors.EVENT_READ)
    selector.register(listener, selectors.EVENT_READ)
    selector.register(sig_r, selectors.EVENT_READ)
    clients = [owner]
    asked_by: dict[int, socket.socket] = {}  # a child's pid: the harness its exit code goes to
    while True:
        for key, _ in selector.select():
            if key.fileobj is sig_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(sig_r, 4096)
                while True:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    with contextlib.suppress(OSError):
                        asked_by.pop(pid, owner).send(
                            json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
                continue
            if key.fileobj is listener:
                with contextlib.suppress(OSError):
                    conn, _ = listener.accept()
                    selector.register(conn, selectors.EVENT_READ)
                    clients.append(conn)
                    conn.send(json.dumps(ready).encode())
                continue
            conn = key.fileobj
            try:
                data, fds, _, _ = socket.recv_fds(conn, _MESSAGE, 1)
            except OSError:
                data, fds = b"", []
            if not data:  # that harness closed the socket or died
                if conn is owner:
                    return None
                selector.unregister(conn)
                clients.remove(conn)
                conn.close()
                continue
            request = json.loads(data)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                selector.close()
                os.close(sig_r)
                os.close(sig_w)
                for sock in (*clients, listener):
                    sock.close()
                return request, fds[0]
            for fd in fds:
                os.close(fd)
            asked_by[pid] = conn
            with contextlib.suppress(OSError):
                conn.send(json.dumps({"started": pid}).encode())


def _become(request: dict, log_fd: int) -> None:
    """In the forked child: take the job's session, streams, directory and environment."""
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["-m", *request["args"]]  # runpy puts the module's file in argv[0], as `python -m` does


def main(argv: list[str]) -> None:
    sock = socket.socket(fileno=int(argv[0]))
    loaded, failed = _preload([n for n in argv[1].split(",") if n])
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_initialized():  # never reached through imports; forking it would break the children
            print("the zygote initialised CUDA while importing: it cannot fork workers", file=sys.stderr)
            sys.exit(1)
    # what the imports made stays out of the children's garbage collections: a collection writes to
    # every object it visits, and each page it writes is copied into the child (copy-on-write)
    gc.freeze()
    # the folder the harness made for the socket (0700: only this user's harnesses connect), else one of its own
    folder = argv[2] if len(argv) > 2 else tempfile.mkdtemp(prefix="oom-harness-zygote-")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(os.path.join(folder, "socket"))
    listener.listen()
    ready = {"ready": os.getpid(), "loaded": loaded, "failed": failed, "threads": threading.active_count(),
             "at": time.time(), "socket": listener.getsockname()}
    try:
        sock.send(json.dumps(ready).encode())  # fails where the harness is gone already
        job = _serve(sock, listener, ready)
    except OSError:
        job = None
    finally:
        if os.getpid() == ready["ready"]:  # the zygote, not a child leaving to run its job
            listener.close()
            shutil.rmtree(folder, ignore_errors=True)
    if job is None:
        # Nothing of the imports needs tearing down: exit as a child does, without the interpreter's
        # finalization (over a second with torch imported, which a stopped harness waits for).
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(0)
    request, log_fd = job
    _become(request, log_fd)
    os._exit(_run(request["module"]))


def _run(module: str) -> int:
    """Run the job's module as `python -m` does and return its exit code, after what the interpreter
    does at exit that a job may rely on: non-daemon threads joined, atexit handlers run, streams
    flushed. The interpreter's own finalization (clearing every module the zygote imported) is
    skipped: it frees nothing the end of the process does not, and writing to the inherited objects
    would copy their pages into the child (over 1 s of CPU per job)."""
    import runpy
    import traceback

    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code


if __name__ == "__main__":
    main(sys.argv[1:])
