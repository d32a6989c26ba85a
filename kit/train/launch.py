"""The tasks meeting: the rendezvous checked before init_process_group (a wrong MASTER_ADDR or port is one line,
not a hang), the process group itself (init_distributed: the page's dist.init_process_group) and the CPU-side gloo
group, start-up problems agreed across the tasks (Tasks.agree), nccl's environment by torch release (the flight
recorder's names); and a task that hangs: its stacks on stderr and the Watchdog.
Owns: Tasks (the run's tasks once they met). Imports: idr_torch, kit.findings, kit.train.errors.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import os
import re
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import idr_torch
from kit.findings import first_line
from kit.train.errors import Quiet, RunError, TaskError, log


def flight_recorder_names(torch_version: str) -> tuple[str, str]:
    """The names this torch release reads first for nccl's flight recorder: (its buffer size, its dump file). Set
    under the other name, a release either ignores the value or prints "Environment variable ... is deprecated; use
    ... instead" (WARN_ENV_VAR_ONCE in c10d/Utils.hpp: getCvarInt/getCvarString warn for any name of a list but the
    first that is set; 2.11 printed it twice per task, once per FlightRecorder instance). The sources:
      - 2.3.1, 2.4.1 (TraceUtils.h), 2.6.0 (FlightRecorder.hpp:103): getCvarInt({"TORCH_NCCL_TRACE_BUFFER_SIZE"}, 0)
        and getCvarString({"TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}, "/tmp/nccl_trace_rank_"); no TORCH_FR_ name in their
        libtorch_cuda.so. 2.5 and 2.7 lie between: pytorch#152563, which added the TORCH_FR_ names ("Make FR vendor
        neutral"), was merged on 2025-05-07, after 2.7.0.
      - 2.8.0 (FlightRecorder.hpp:100), 2.13.0 and 2.14.1 (FlightRecorder.hpp:111): getCvarInt({"TORCH_FR_BUFFER_SIZE",
        "TORCH_NCCL_TRACE_BUFFER_SIZE"}, 0 in 2.8, 2000 later), and FlightRecorder.cpp's getCvarString(
        {"TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}, ...) (both names in 2.8.0's and 2.14.1's
        libtorch_cpu.so); 2.11.0 on the H200 printed the deprecation for TORCH_NCCL_TRACE_BUFFER_SIZE.
    ProcessGroupNCCL itself still reads TORCH_NCCL_TRACE_BUFFER_SIZE alone (its traceBufferSize_, which gates the
    dump, default 2000 from 2.8: the default FlightRecorder's was brought up to by pytorch#172843), and
    TORCH_NCCL_DUMP_ON_TIMEOUT has that one name in every release (ProcessGroupNCCL.hpp)."""
    major, minor = (int(x) for x in re.findall(r"\d+", torch_version)[:2])
    if (major, minor) >= (2, 8):
        return "TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"
    return "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"


def nccl_environment() -> str:
    """What a hang and an error leave to read, set before the first nccl group (each release reads these once, in
    ProcessGroupNCCL's constructor); a value the user exported wins. Names and defaults from each release's
    ProcessGroupNCCL.hpp (and FlightRecorder.hpp from 2.8), and the strings in its libtorch_cuda.so:
      - TORCH_NCCL_ASYNC_ERROR_HANDLING (older name NCCL_ASYNC_ERROR_HANDLING, still read, with a deprecation
        warning, by every release from 2.3.1 to 2.14.1): left at the releases' default 3, "SkipCleanUp": when a
        collective times out the watchdog ends the process without ncclCommAbort, which can itself hang on a dead
        peer. 0 (or 2) would leave the job waiting until its time limit; a value the user set is kept and named.
      - TORCH_NCCL_BLOCKING_WAIT: not set. It makes every wait() block the CPU until the collective ends (the
        timeout then raises in Python), so the CPU stops queuing work ahead of DDP's all-reduces; the watchdog
        above times out the same collectives without that cost.
      - Flight recorder, under the names this release reads first (flight_recorder_names): its buffer size = 2000
        last collectives per task (the default is 0, off, in the older sources, 2000 in the newer);
        TORCH_NCCL_DUMP_ON_TIMEOUT=1 (off by default in 2.3) writes them when the watchdog fires, to its dump
        file + <rank>, by default /tmp/nccl_trace_rank_<rank> (~/.cache/torch/comm_lib_trace_rank_ later): a
        compute node's disk, gone with the job, so here the job's folder: nccl_trace_<job>/rank_<rank>. Read it
        with `torchfrtrace nccl_trace_<job>` (2.6 on) or pickle.load (docs/gpu.md).
      - NCCL_DEBUG=WARN: nccl prints its own errors (e.g. "Duplicate GPU detected : rank 0 and rank 1 both on CUDA
        device ...", a network failure) on stderr, not only an error code."""
    env, said = os.environ, []
    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT",
                 "NCCL_BLOCKING_WAIT"):
        if env.get(name, "").strip():
            said.append(f"{name}={env[name]} (yours)")
    mode = env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", env.get("NCCL_ASYNC_ERROR_HANDLING", "3")).strip()
    if mode in ("0", "2"):
        said.append("warning: with async error handling 0 or 2 a collective whose peer died blocks until the time "
                    "limit; unset it (the default, 3, ends the task after --timeout)")
    size_name, file_name = flight_recorder_names(torch.__version__)
    size = read_first(env, size_name, "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE") or "2000"
    env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    trace = read_first(env, file_name, "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    if trace is None:
        folder = Path(f"nccl_trace_{idr_torch.current().job_id or os.getpid()}").resolve()
        with contextlib.suppress(OSError):
            folder.mkdir(exist_ok=True)
            atexit.register(_remove_if_empty, folder)  # a run that ends normally leaves no empty folder behind
        trace = env[file_name] = f"{folder}/rank_"
    env.setdefault(size_name, size)
    env.setdefault("NCCL_DEBUG", "WARN")
    return ", ".join(said + [f"on a timeout each task writes its last {size} collectives to {trace}<rank> (flight "
                             "recorder) and its Python stacks to stderr"])


def read_first(env: dict[str, str], name: str, *names: str) -> str | None:
    """The user's value: under `name` (the one this release reads first), else under another of `names`, then
    copied to `name` only where this release does not read that other one (an older release and a TORCH_FR_ name:
    ignored there). A value under the older name on a newer release is left as it is, with torch's warning: the
    user's choice."""
    if env.get(name, "").strip():
        return env[name]
    for other in names:
        if other != name and env.get(other, "").strip():
            if other.startswith("TORCH_FR_"):
                env[name] = env[other]
            return env[other]
    return None


def _remove_if_empty(folder: Path) -> None:
    with contextlib.suppress(OSError):
        folder.rmdir()


# errors every task sees: the start-up network, each task's own verdict, lost contact
def this_task(launch: idr_torch.Launch) -> str:
    """'task 3 on r7i1n2: ' where several tasks run (the prefix of a task's own error line), else ''."""
    return f"task {launch.rank} on {socket.gethostname()}: " if launch.size > 1 else ""


@dataclasses.dataclass
class Tasks:
    """The run's tasks once they met (init_distributed makes it; run() passes it down): who this task is (idr_torch's
    Launch), the group its CPU-side collectives run on, and the program's name in their error lines."""
    launch: idr_torch.Launch
    host_group: dist.ProcessGroup | None = None  # gloo; None: the default group is gloo already (no GPU)
    prog: str = "bench_ddp_transformer"

    def agree(self, problem: str | None, value: object = None) -> list:
        """Every task's verdict on what it read or wrote alone (the folders of its node, files truncated on one node,
        the --load file on node-local storage), gathered on the CPU group: a task that failed says its own error
        (prefixed with its rank and host), the first task that did not says which failed, the others stop quietly;
        the same error on every task is said once. Returns every task's `value` when no task failed."""
        launch = self.launch
        if launch.size == 1:
            if problem:
                raise RunError(problem)
            return [value]
        verdicts: list = [None] * launch.size
        dist.all_gather_object(verdicts, (problem, socket.gethostname(), value), group=self.host_group)
        failed = [(rank, host, p) for rank, (p, host, _) in enumerate(verdicts) if p]
        if not failed:
            return [v for _, _, v in verdicts]
        if len(failed) == launch.size and len({p for _, _, p in failed}) == 1:
            raise RunError(problem)  # said once, by task 0
        if problem:
            raise TaskError(f"{this_task(launch)}{problem}")
        if launch.rank == min(rank for rank, (p, _, _) in enumerate(verdicts) if not p):
            rank, host, p = failed[0]
            more = f" (and {len(failed) - 1} other task(s))" if len(failed) > 1 else ""
            raise TaskError(f"{this_task(launch)}stopping: task {rank} on {host} failed{more}: {p[:300]}")
        raise Quiet()


def init_distributed(timeout: float, cuda: bool, gpus: list[int], prog: str = "bench_ddp_transformer") -> Tasks:
    """The page's dist.init_process_group(backend='nccl', init_method='env://', world_size=idr_torch.size,
    rank=idr_torch.rank); gloo where there is no GPU. `gpus`: this task's GPUs, first_part first
    (kit.train.setup.use_gpus); [] without one. Returns the Tasks, with the CPU side's gloo group.

    device_id= binds the nccl group to one GPU: its communicator is created here (an error shows at start-up, not
    at the first collective), barrier() uses it, and subgroups are split from it. But any collective on another GPU
    then raises "Attempt to perform collective on tensor not on device passed to init_process_group"
    (ProcessGroupNCCL::getNCCLComm, every release from 2.3.1 to 2.14.1), and DDP all-reduces each bucket on the GPU
    of its parameters: so only a task whose parts are all on one GPU binds (nb_part 1, the stage layout, --devices
    0,0); the page's multi-GPU replica does not."""
    if cuda:
        log(f"nccl: {nccl_environment()}")
    report_hangs()
    idr_torch.export_env()  # MASTER_ADDR/PORT (kept if already set), RANK, WORLD_SIZE, LOCAL_RANK
    bind = {"device_id": torch.device("cuda", gpus[0])} if cuda and len(gpus) == 1 else {}
    dist.init_process_group("nccl" if cuda else "gloo", init_method="env://", world_size=idr_torch.size,
                            rank=idr_torch.rank, timeout=timedelta(seconds=timeout), **bind)
    # The CPU side's collectives (the stop flag, Python objects, the data barrier) run on gloo: on nccl an object
    # collective goes to the current device and syncs its stream (_object_to_tensor(obj, "cuda") in 2.3.1 to
    # 2.14.1), and a barrier picks a GPU by its own guess (see kit.train.data.load_corpus).
    return Tasks(idr_torch.current(), dist.new_group(backend="gloo") if cuda else None, prog)


def check_rendezvous(launch: idr_torch.Launch, timeout: float) -> None:
    """Before init_process_group: the master's address resolves (every task, within seconds); on task 0, which
    serves the rendezvous, it is an address of this host and the port is free. One line per task, instead of
    160 lines of C++ frames after 2.6 x --timeout (an unresolvable name) or a task that waits for minutes on a
    port another program holds."""
    addr, port = launch.master_addr, launch.master_port
    given = launch.master_addr_given
    where = f"node {addr} ({'MASTER_ADDR' if given else 'the first node of the step, where task 0 runs'})"
    fix = ("export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1), or unset it: the kit "
           "then uses the step's first node" if given else "check the node names Slurm gives (SLURM_STEP_NODELIST)")
    limit = max(1.0, min(timeout, 20.0))
    found: dict = {}

    def lookup() -> None:
        try:
            found["ips"] = sorted({info[4][0] for info in socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)})
        except (OSError, UnicodeError) as exc:
            found["error"] = getattr(exc, "strerror", None) or str(exc)

    resolver = threading.Thread(target=lookup, daemon=True)  # a resolver that never answers must not hang us
    resolver.start()
    resolver.join(limit)
    if "ips" not in found:
        why = found.get("error") or f"no answer within {limit:g}s"
        raise TaskError(f"{this_task(launch)}{where} does not resolve ({why}): the tasks cannot meet; {fix}")
    if launch.rank != 0 or launch.agent_store:
        return  # torchrun's agent serves the rendezvous itself, on this port: nothing for task 0 to check
    if not any(local_address(ip) for ip in found["ips"]):
        raise TaskError(f"{this_task(launch)}{where} is {', '.join(found['ips'])}, not an address of this host "
                        f"({socket.gethostname()}), where task 0 serves the rendezvous: the other tasks would wait "
                        f"for nobody; {fix}")
    for family, wildcard in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):  # as torch's TCPStore binds
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 here
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((wildcard, port))
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL:
                    continue
                held = exc.errno == errno.EADDRINUSE
                raise TaskError(f"{this_task(launch)}port {port} (MASTER_PORT) on {socket.gethostname()} "
                                + ("is in use by another program" if held else f"cannot be used ({exc.strerror})")
                                + ": task 0 serves the rendezvous there; export MASTER_PORT=<a free port in "
                                "10000-29999> (the same for every task), or unset it: the kit derives one from the "
                                "job id") from None


def local_address(ip: str) -> bool:
    """Whether `ip` is one of this host's addresses (only those can be bound)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


@contextlib.contextmanager
def rendezvous_deadline(launch: idr_torch.Launch, timeout: float, prog: str = "bench_ddp_transformer"):
    """init_process_group within --timeout, said in one line. A task whose peer on MASTER_PORT is another program
    (it accepts the connection and never answers) waited 200 s at --timeout 30, in C++, where no Python exception
    reaches it: a timer ends it at --timeout + 15 s."""
    where = f"{launch.master_addr}:{launch.master_port}"
    what = (f"{this_task(launch)}the {launch.size} tasks did not all meet at {where} within --timeout {timeout:g}s"
            if launch.size > 1 else f"the process group did not start at {where} within --timeout {timeout:g}s")

    def give_up() -> None:
        print(f"{prog}: error: {what}: task 0 is not serving the rendezvous there (it failed to start: see its "
              "error; or the port is another program's); every task stops", file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(timeout + 15, give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    except (RuntimeError, ValueError) as exc:  # DistNetworkError, DistStoreError (a timeout) and their kin
        raise TaskError(f"{what} ({first_line(exc)[:200]}): a task did not start, or cannot reach task 0's node; "
                        "every task stops") from None
    finally:
        timer.cancel()


# What a collective raises when a peer task died or hung, and nothing else: gloo's "Connection closed by peer"
# (seen here, torch 2.13 CPU, a killed peer) and its "Timed out waiting ... for recv"; a reset or broken socket
# (ECONNRESET, EPIPE); NCCL's ncclRemoteError "remote process exited or there was a network error".
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting",
             "remote process exited or there was a network error")


def is_comm_error(exc: BaseException) -> bool:
    """A collective failed because a peer died, hung (timeout) or closed its connection; any other error keeps
    its own message and traceback."""
    return isinstance(exc, getattr(dist, "DistNetworkError", ())) or any(k in str(exc) for k in PEER_GONE)


def report_hangs() -> None:
    """Python's stacks of every thread on stderr when the process dies of a signal: the nccl watchdog ends a task
    with std::abort (SIGABRT) after --timeout; a segfault in a library likewise. The Watchdog below covers the
    hangs nccl does not see (gloo, a send or receive, Python itself)."""
    import faulthandler
    if not faulthandler.is_enabled():
        faulthandler.enable(file=sys.stderr, all_threads=True)


class Watchdog:
    """Ends this task with its stacks and one line when a step makes no progress for `timeout` seconds.

    A rank blocked in a pipelining send or receive waits in C++ with no timeout (gloo's and nccl's point-to-point, on
    the releases tested), a rank stuck in Python (a Pipe worker, the data) has none at all, and Python runs signal
    handlers only between bytecodes, so neither SIGTERM nor the stop request reaches it. This thread still runs (the
    wait releases the GIL). It fires `grace` seconds after --timeout so that on nccl the watchdog's flight-recorder
    dump comes first (TORCH_NCCL_DUMP_ON_TIMEOUT; nccl's watchdog waits TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC, 2 to
    60 s by release, for it before it ends the task)."""

    def __init__(self, timeout: float, rank: int, prog: str = "bench_ddp_transformer", grace: float = 90.0) -> None:
        self.timeout, self.rank, self.prog, self.grace = timeout, rank, prog, grace
        self.step, self.beat = 0, time.monotonic()
        self.done = threading.Event()
        threading.Thread(target=self._watch, name="watchdog", daemon=True).start()

    def tick(self, step: int) -> None:
        self.step, self.beat = step, time.monotonic()

    def stop(self) -> None:
        self.done.set()

    def _watch(self) -> None:
        import faulthandler
        limit = self.timeout + self.grace
        while not self.done.wait(min(5.0, limit / 4)):
            idle = time.monotonic() - self.beat
            if idle > limit:
                print(f"{self.prog}: error: task {self.rank} made no progress for {idle:.0f}s after step "
                      f"{self.step} (--timeout {self.timeout:g}): a collective, send or receive never completed "
                      "(a task died or hung; each task's Python stacks follow, and on nccl its last collectives in "
                      "the flight recorder's file); stopping instead of waiting for the time limit",
                      file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(1)
