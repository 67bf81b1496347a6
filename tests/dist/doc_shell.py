"""The shell the docs' commands run in: `python` and `torchrun` served by a preloaded fork server.

A doc block is run by bash as written; what makes it cheap is the PATH it runs with (see
`tests/dist/test_docs_commands.py`). `python ARGS` and `torchrun ARGS` there are small shims that
exec this file as a *client*:

    client ARGS      ARGS are python's: `-m trainer.X ...`, `-c CODE`, `scripts/X.py ...`, `-`
                     (stdin). It sends them with its cwd, environment and stdin/stdout/stderr (the
                     file descriptors themselves, SCM_RIGHTS) to the server, forwards the signals
                     it gets to the process the server forked, and exits with its status.
                     Anything else (`python -m pip`, `python3.11 -m venv`) execs the real python.
    serve SOCKET     imports torch, transformers and the trainer once (`TRAINER_PRELOAD`, as
                     tests/dist/harness.py's groups), then forks one child per request: the child
                     takes the request's cwd, environment, argv and descriptors, and runs the
                     module, script or code as `python` would (`runpy`), in its own process group.

A training rank thus starts in milliseconds instead of seconds of imports on 2 cores. torchrun is
served too: `torchrun [opts] -m MOD ARGS` becomes `python -m torch.distributed.run [opts]
--no-python CLIENT -m MOD ARGS`, so its workers are clients as well (torchrun's own agent, its
rendezvous, environment and signal handling are unchanged).

`DOC_TEST_MODE=check` makes a `trainer.train` or `trainer.plan` launch a check instead of a run (a
GPU-sized job): the flags are parsed and the job validated for its world size by `trainer.run.
preflight.validate_early`, the trainer's own first step; under torchrun nothing is launched, the
world size is torchrun's `--nnodes` x `--nproc-per-node` (the planner's: `--world_size`). `DOC_TEST_TRAIN_ARGS` (shell words) are
appended to every `trainer.train` launch: the marker's tiny-scale flags (later flags win).

This file imports only the standard library at the top: the client starts in ~30 ms.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import struct
import sys
from typing import Any

SOCKET_ENV = "DOC_TEST_SOCKET"  # the server's unix socket
PYTHON_ENV = "DOC_TEST_PYTHON"  # the real interpreter
CLIENT_ENV = "DOC_TEST_CLIENT"  # the executable client shim (torchrun's --no-python entry point)
MODE_ENV = "DOC_TEST_MODE"  # "run" (default) or "check"
TRAIN_ARGS_ENV = "DOC_TEST_TRAIN_ARGS"
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
CHECKED = ("trainer.train", "trainer.plan")  # what check mode validates instead of running
SERVED_PREFIXES = ("trainer.", "torch.distributed.run", "scripts.", "tests.")
FALLBACKS_ENV = "DOC_TEST_FALLBACKS"  # a file that collects why commands ran unserved (`_note_fallback`)
IMPORT_ENV = "DOC_TEST_IMPORT_ENV"  # the server's import-time environment (JSON; see `import_env`)
# Variables read when the preloaded modules (torch, transformers, huggingface_hub, datasets, tqdm,
# matplotlib) are imported: a request whose values differ from the server's is not served (the
# preloaded modules would carry the server's).
_IMPORT_NAMES = ("PYTHONPATH", "PYTHONHASHSEED", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCH_HOME",
                 "TORCH_LOGS", "TRANSFORMERS_CACHE", "TRANSFORMERS_OFFLINE", "TRANSFORMERS_VERBOSITY",
                 "HUGGINGFACE_HUB_CACHE", "HF_HOME", "HF_ENDPOINT", "SACREBLEU", "MPLBACKEND", "MPLCONFIGDIR")  # fmt: skip
_IMPORT_PREFIXES = ("HF_HUB_", "HF_DATASETS_", "TQDM_", "TORCHINDUCTOR_", "TORCHDYNAMO_")


def import_env(env: dict[str, str]) -> dict[str, str]:
    """The part of `env` that importing the preloaded modules reads."""
    return {k: v for k, v in env.items() if k in _IMPORT_NAMES or k.startswith(_IMPORT_PREFIXES)}


# ---------------------------------------------------------------------------------------------
# client


def _torchrun_argv(args: list[str]) -> tuple[list[str], list[str], dict[str, str]]:
    """Split `torchrun` args at the module: (torchrun options, [MOD, *ARGS], {option: value})."""
    opts: dict[str, str] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-m", "--module"):
            return args[:i], args[i + 1 :], opts
        if not a.startswith("-"):
            raise SystemExit(f"doc_shell: torchrun without -m MODULE is not served: {args}")
        name, eq, value = a.partition("=")
        key = name.lstrip("-").replace("_", "-")
        if eq:
            opts[key] = value
        elif key in ("standalone", "no-python", "run-path", "tee", "redirects") or (
            i + 1 < len(args) and args[i + 1].startswith("-")
        ):
            opts[key] = ""
        else:
            opts[key] = args[i + 1] if i + 1 < len(args) else ""
            i += 1
        i += 1
    raise SystemExit(f"doc_shell: torchrun without -m MODULE is not served: {args}")


def _with_train_args(module: str, args: list[str]) -> list[str]:
    extra = os.environ.get(TRAIN_ARGS_ENV, "")
    return [*args, *shlex.split(extra)] if module == "trainer.train" and extra else args


def _request(argv: list[str]) -> dict[str, Any] | None:
    """What the server should run for `python argv`, or None: exec the real interpreter (also when
    this environment would have imported torch or transformers differently from the server's)."""
    env = dict(os.environ)
    if argv[:1] == ["-u"]:
        argv = argv[1:]
    # A checked launch only parses and validates (`check_launch`): served whatever the environment
    # (a block's HF_HUB_OFFLINE=1 would otherwise send `torchrun --rdzv-endpoint node0:...` to a real
    # torchrun).
    launched = argv[1:2] if argv[:1] == ["-m"] else []
    if launched == ["torch.distributed.run"]:
        launched = argv[argv.index("-m", 2) + 1 :][:1] if "-m" in argv[2:] else []
    checked = env.get(MODE_ENV) == "check" and bool(launched) and launched[0] in CHECKED
    if IMPORT_ENV in env and json.loads(env[IMPORT_ENV]) != import_env(env) and not checked:
        return None
    if len(argv) >= 2 and argv[0] == "-m" and argv[1].startswith(SERVED_PREFIXES):
        module, args = argv[1], argv[2:]
        if module == "torch.distributed.run":
            opts, rest, parsed = _torchrun_argv(args)
            module_run, margs = rest[0], _with_train_args(rest[0], rest[1:])
            if env.get(MODE_ENV) == "check" and module_run in CHECKED:
                nproc = int(parsed.get("nproc-per-node", "1") or 1)
                nnodes = int(parsed.get("nnodes", "1").split(":")[-1] or 1)
                env.update(WORLD_SIZE=str(nnodes * nproc), LOCAL_WORLD_SIZE=str(nproc), RANK="0")
                return {"kind": "module", "target": module_run, "args": margs, "env": env}
            if "standalone" not in parsed and "rdzv-endpoint" not in parsed and "master-port" not in parsed:
                env.setdefault("PET_MASTER_PORT", str(_free_port()))  # torchrun's env default
            args = [*opts, "--no-python", env[CLIENT_ENV], "-m", module_run, *margs]
        else:
            args = _with_train_args(module, args)
        return {"kind": "module", "target": module, "args": args, "env": env}
    if len(argv) >= 2 and argv[0] == "-c":
        return {"kind": "code", "target": argv[1], "args": argv[2:], "env": env}
    if argv[:1] == ["-"] or not argv:
        return {"kind": "code", "target": None, "args": argv[1:], "env": env}
    if argv[0].endswith(".py") and not argv[0].startswith("-"):
        return {"kind": "path", "target": argv[0], "args": argv[1:], "env": env}
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _send(sock: socket.socket, payload: bytes, fds: list[int]) -> None:
    socket.send_fds(sock, [struct.pack("!I", len(payload)) + payload], fds)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("doc_shell: connection closed")
        buf += chunk
    return buf


def _note_fallback(argv: list[str]) -> None:
    """Append to `$DOC_TEST_FALLBACKS` (when set) why `argv` runs in a real interpreter: the import
    variables that differ from the server's (a fallback costs seconds of imports; tests/served.py)."""
    path = os.environ.get(FALLBACKS_ENV)
    if not path:
        return
    served = json.loads(os.environ.get(IMPORT_ENV, "{}"))
    mine = import_env(dict(os.environ))
    differ = sorted(k for k in set(served) | set(mine) if served.get(k) != mine.get(k))
    with open(path, "a") as f:
        f.write(json.dumps({"argv": argv[:4], "cwd": os.getcwd(), "differ": differ}) + "\n")


def client(argv: list[str]) -> int:
    req = _request(argv)
    if req is None:
        real = os.environ[PYTHON_ENV]
        _note_fallback(argv)
        os.execv(real, [real, *argv])
    req["cwd"] = os.getcwd()
    if "TORCHELASTIC_RUN_ID" in os.environ and sys.platform.startswith("linux"):
        # A torchrun rank: the served process's parent is the server, not the agent, so this client
        # stands in for it. When the agent dies the client gets SIGTERM and forwards it, as a rank
        # that watches its agent takes the SIGTERM path (trainer.run.faults).
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:
            os.kill(os.getpid(), signal.SIGTERM)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(os.environ[SOCKET_ENV])
    _send(sock, json.dumps(req).encode(), [0, 1, 2])
    (pid,) = struct.unpack("!i", _recv_exact(sock, 4))

    def forward(signum: int, _frame: Any) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for s in SIGNALS:
        signal.signal(s, forward)
    (status,) = struct.unpack("!i", _recv_exact(sock, 4))
    if status < 0:  # killed by a signal: die of it too, as the process would have
        for s in SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        return 128 - status
    return status


# ---------------------------------------------------------------------------------------------
# server


def check_launch(module: str, argv: list[str]) -> None:
    """A `trainer.train` or `trainer.plan` launch checked, not run: its flags parsed and the job
    validated for its world size by `validate_early` (for the planner: the config's own layout on
    `--world_size` ranks, `--gpus_per_node` to a node)."""
    from trainer.config.parse import parse_config
    from trainer.errors import BAD_INPUT
    from trainer.run.preflight import validate_early

    try:
        if module == "trainer.plan":
            from trainer.planner.options import parse_args

            opts, overrides = parse_args(argv)
            world = opts.world_size
            os.environ["LOCAL_WORLD_SIZE"] = str(opts.gpus_per_node or world)
            cfg = parse_config(["--config", opts.config, *overrides])
        else:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            cfg = parse_config(argv)
        dims = validate_early(cfg, world)
    except BAD_INPUT as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"doc-test check: {module} on {world} ranks: mesh pp={dims.pp} dp={dims.dp} tp={dims.tp}")


def _new_std_streams() -> None:
    """sys.stdin/stdout/stderr over the request's descriptors, buffered as python would buffer them
    (the server's own objects remember what its descriptors were: a file, seekable)."""
    import io

    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        mode = "r" if fd == 0 else "w"
        tty = os.isatty(fd)
        stream = open(  # noqa: SIM115 - the process's own stream, open until it exits
            fd,
            mode,
            encoding="utf-8",
            closefd=False,
            errors="backslashreplace" if fd == 2 else "strict",
            buffering=1 if (tty or fd == 2) and fd else -1,
        )
        if fd and unbuffered and isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(write_through=True)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _run_child(req: dict[str, Any], fds: list[int]) -> int:
    import runpy
    import traceback

    for i, fd in enumerate(fds):
        os.dup2(fd, i)
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    _new_std_streams()
    if os.environ.get(
        "DOC_TEST_SHIMS"
    ):  # what the program starts as python is served too (trainer.plan --validate)
        sys.executable = os.path.join(os.environ["DOC_TEST_SHIMS"], "python")
    kind, target, args = req["kind"], req["target"], req["args"]
    try:
        if kind == "module":
            sys.argv = [target, *args]
            if target in CHECKED and os.environ.get(MODE_ENV) == "check":
                check_launch(target, args)
            else:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif kind == "path":
            sys.argv = [target, *args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
        else:
            code = target if target is not None else sys.stdin.read()
            sys.argv = ["-c" if target is not None else "-", *args]
            exec(compile(code, sys.argv[0], "exec"), {"__name__": "__main__"})
        status = 0
    except SystemExit as e:
        if e.code is None:
            status = 0
        elif isinstance(e.code, int):
            status = e.code
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException:  # noqa: BLE001 - the traceback is the child's output, as python prints it
        traceback.print_exc()
        status = 1
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    return status


def serve(path: str, preload: list[str]) -> None:
    import importlib
    import selectors

    for name in preload:
        importlib.import_module(name)
    # SIGTERM (the test's teardown) ends the loop through `finally`, which kills what is still running
    # (each child leads a process group of its own, which a kill of the server's group misses).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(128)
    sel = selectors.DefaultSelector()
    sel.register(srv, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    print("ready", flush=True)
    try:
        while True:
            for key, _ in sel.select(timeout=0.02):
                if key.fileobj is srv:
                    conn, _ = srv.accept()
                    raw, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
                    (n,) = struct.unpack("!I", raw[:4])
                    data = raw[4:]
                    while len(data) < n:
                        data += _recv_exact(conn, n - len(data))
                    req = json.loads(data)
                    sys.stdout.flush()
                    sys.stderr.flush()
                    pid = os.fork()
                    if pid == 0:
                        os.setpgid(0, 0)
                        for s in (*SIGNALS, signal.SIGCHLD):
                            signal.signal(s, signal.SIG_DFL)
                        sel.close()
                        srv.close()
                        conn.close()
                        for c in children.values():
                            c.close()
                        os._exit(_run_child(req, fds))
                    for fd in fds:
                        os.close(fd)
                    conn.sendall(struct.pack("!i", pid))
                    children[pid] = conn
                    sel.register(conn, selectors.EVENT_READ, pid)
                else:  # a client went away (killed) before its process ended: end the process
                    pid = key.data
                    if not key.fileobj.recv(1):  # type: ignore[union-attr]
                        sel.unregister(key.fileobj)
                        try:
                            os.killpg(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
            while children:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                if pid not in children:
                    continue
                conn = children.pop(pid)
                code = os.waitstatus_to_exitcode(status)
                try:
                    sel.unregister(conn)
                except (KeyError, ValueError):
                    pass
                try:
                    conn.sendall(struct.pack("!i", code))
                except OSError:
                    pass
                conn.close()
    finally:
        for pid in children:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    if sys.argv[1] == "client":
        sys.exit(client(sys.argv[2:]))
    serve(sys.argv[2], sys.argv[3].split(",") if len(sys.argv) > 3 else [])
