"""A recording stand-in for CUDA and nccl: a trainer's GPU branch runs on the CPU and says which GPU it would use.

    python tests/cuda_standin.py OUT_DIR bench_ddp_transformer.py --nb-part 2 ...   # per task, srun-like env

The trainer runs unchanged, as `__main__`, with `torch.cuda.is_available()` true and KIT_STANDIN_GPUS (default 4)
GPUs. Tensors really live on the CPU and collectives really run on gloo, so the training is real; what is faked is
where things would be, and that is recorded, in order, into OUT_DIR/rank<SLURM_PROCID>.json:
  - every `torch.cuda.set_device`, and every first use of a GPU ("touch": a tensor placed there, a synchronize, a
    memory query): a task that touches a GPU before set_device has a context on the wrong one;
  - every collective with its process group, the backend the trainer asked for (nccl or gloo) and, on nccl, the GPU
    nccl would run it on, by the rules of ProcessGroupNCCL in each release of the matrix (below);
  - DDP's own collectives, which run in C++ where no Python hook sees them, from the module's placement by the rules
    of reducer.cpp and comm.cpp (below).
tests/test_gpu_rules.py turns the records of every task into nccl's communicators and checks them.

nccl's rules, read in each release's sources (2.3.1, 2.4.1, 2.6.0, 2.8.0, 2.13.0, 2.14.1; the Python in each lane's
torch/distributed/, the C++ in pytorch/pytorch torch/csrc/distributed/c10d/, with each wheel's libtorch_cuda.so
holding the messages quoted):
  - A tensor collective runs on its tensor's GPU. ProcessGroupNCCL keeps one communicator per GPU index and process
    group (devNCCLCommMap_, keyed by the device); a new one takes the next number of the group's counter
    (broadcastUniqueNCCLID: `storeKey = std::to_string(ncclCommCounter_++)`), so the k-th communicator a task
    creates in a group pairs with the k-th of every other task: they must agree, or the tasks wait for each other
    until the timeout. nccl itself refuses two ranks of one communicator on one GPU of one host (NVIDIA/nccl
    src/init.cc: "Duplicate GPU detected : rank %d and rank %d both on CUDA device %lx", ncclInvalidUsage).
  - send/recv between two ranks use a communicator of the pair (getKeySendRecv "low:high"), on the tensor's GPU.
  - barrier() all-reduces one float on: device_ids[0] if given, else the device bound by init_process_group
    (device_id=), else the lowest GPU this group already used (`*usedDeviceIdxs_.begin()`), else global rank %
    local GPU count. Same order in every release: ProcessGroupNCCL::barrier in 2.3.1 to 2.6.0 ("using GPU %d to
    perform barrier as devices used by this process are currently unknown"), guessDeviceId() in 2.8.0 ("... as
    device used by this process is currently unknown") and 2.13/2.14 ("Guessing device ID based on global rank"),
    which barrier()'s docstring in 2.13 lists as (1)-(4). From 2.8 the Python sets opts.device to
    `torch._C._get_accelerator()`, a device with no index, and warns "using the device under current context": the
    current device is not what the C++ uses.
  - Object collectives (all_gather_object, gather_object, broadcast_object_list) move the pickle to
    `_get_pg_default_device(group)` (2.3.1, 2.4.1) or `_get_object_coll_device(group)` (2.6 on): the device type
    "cuda" with no index for an nccl group, hence the current device. send/recv_object_list take a device= and
    pipelining passes its stage's.
  - init_process_group(device_id=d) binds the group to d: a collective on any other GPU raises "Attempt to perform
    collective on tensor not on device passed to init_process_group" (getNCCLComm, every release), so it fits a task
    with one GPU, never a module over several.
  - DDP over a module on several GPUs (no device_ids): verify_params_across_processes all-gathers on
    params[0].device() (reducer.cpp); _sync_module_states broadcasts parameters then buffers with
    broadcast_coalesced, in buckets that never span devices, ordered by their first tensor (comm.cpp,
    compute_bucket_assignment_by_size); each gradient bucket is all-reduced on its own GPU; sync_bucket_indices
    (the first rebuild) and find_unused_parameters' map use params[0].device(). Same in every release of the matrix
    (DDP.__init__ calls _verify_param_shape_across_processes then _sync_module_states in each).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import runpy
import sys
import threading
import weakref
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.overrides import TorchFunctionMode

GPUS = int(os.environ.get("KIT_STANDIN_GPUS", "4"))


class Recorder:
    """Everything the task did with GPUs and groups, in order."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.lock = threading.Lock()
        self.local = threading.local()  # the current device, per thread as in the CUDA runtime
        self.backend_of: dict = {}  # ProcessGroup -> the backend the trainer asked for
        self.default_backend = "gloo"
        self.bound: int | None = None  # init_process_group(device_id=)
        self.used: dict[tuple, list[int]] = {}  # nccl group -> GPUs its collectives used (the barrier's 3rd choice)
        self.depth = threading.local()  # collectives inside collectives (object ones) are recorded once

    def current(self) -> int:
        return getattr(self.local, "device", 0)

    def add(self, **event: object) -> None:
        event["thread"] = threading.current_thread().name
        with self.lock:
            self.events.append(event)

    def touch(self, device: int, what: str) -> None:
        self.add(kind="touch", device=device, what=what)


REC = Recorder()


def gpu_index(device: object = None) -> int:
    """A CUDA device (int, 'cuda:1', torch.device) to its index; no index: the current device."""
    if device is None:
        return REC.current()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"not a CUDA device: {device}")
    return REC.current() if device.index is None else device.index


def is_gpu(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


# storage address -> GPU, for the tensors placed explicitly (device=, .to): views of them made where no hook runs (a
# pipeline's receive buffers) share the storage. Forgotten when the tensor goes, so a reused address says nothing.
STORAGE: dict[int, int] = {}


def storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError):  # meta tensors, tensors without storage
        return None


def device_of(t: object) -> int | None:
    """The GPU a tensor would be on; None for a tensor that is really on the CPU."""
    if not isinstance(t, torch.Tensor):
        return None
    if hasattr(t, "_standin_gpu"):
        return t._standin_gpu
    return STORAGE.get(storage_key(t))


def tag(t: object, gpu: int | None, placed: bool = False) -> None:
    """Remember the GPU of `t` (a tensor, or those in a list); `placed`: the trainer put it there explicitly."""
    if isinstance(t, torch.Tensor):
        try:
            t._standin_gpu = gpu
        except (AttributeError, RuntimeError):
            return
        key = storage_key(t) if placed else None
        if key is not None:
            if gpu is None:
                STORAGE.pop(key, None)
            else:
                STORAGE[key] = gpu
                weakref.finalize(t, STORAGE.pop, key, None)
    elif isinstance(t, (list, tuple)):
        for x in t:
            tag(x, gpu, placed)


def first_tensor(*trees: object) -> torch.Tensor | None:
    for x in trees:
        if isinstance(x, torch.Tensor):
            return x
        if isinstance(x, (list, tuple)):
            found = first_tensor(*x)
            if found is not None:
                return found
        if isinstance(x, dict):
            found = first_tensor(*x.values())
            if found is not None:
                return found
    return None


REAL_TO = torch.Tensor.to


def tensor_to(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    """Tensor.to (and so Module.to) in every thread, a Pipe's workers and autograd's backward included: a GPU
    target becomes the CPU, and the result remembers the GPU."""
    target: int | None | str = "same"
    args = list(args)
    for i, a in enumerate(args):
        if is_gpu(a):
            target, args[i] = gpu_index(a), "cpu"
        elif isinstance(a, torch.Tensor):
            target = device_of(a)
        elif isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu":
            target = None
    if is_gpu(kwargs.get("device")):
        target, kwargs["device"] = gpu_index(kwargs["device"]), "cpu"
    out = REAL_TO(self, *args, **kwargs)
    if target == "same":  # a change of dtype only
        if device_of(self) is not None:
            tag(out, device_of(self))
        return out
    if target is not None:
        REC.touch(target, "Tensor.to")
    tag(out, target, placed=True)
    return out


def tensor_cuda(self: torch.Tensor, device: object = None, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor_to(self, torch.device("cuda", gpu_index(device)))


class Placement(TorchFunctionMode):
    """Puts every tensor the trainer creates on a GPU (device=) on the CPU instead, and remembers which GPU it meant;
    results inherit the GPU of their first input that has one. Active in the main thread (modes are per thread),
    where the trainers create tensors; Tensor.to is patched for every thread (tensor_to above)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        target: int | None | str = "inherit"
        if is_gpu(kwargs.get("device")):
            target = gpu_index(kwargs["device"])
            REC.touch(target, getattr(func, "__name__", "factory"))
            kwargs["device"] = "cpu"
        elif getattr(func, "__name__", "") == "__set__" and len(args) == 2:  # param.data = moved (Module.to)
            out = func(*args, **kwargs)
            if isinstance(args[1], torch.Tensor) and device_of(args[1]) is not None:
                tag(args[0], device_of(args[1]))
            return out
        out = func(*args, **kwargs)
        if target == "inherit":
            source = first_tensor(args, kwargs)
            if source is not None and device_of(source) is not None and isinstance(out, (torch.Tensor, list, tuple)):
                if not (isinstance(out, torch.Tensor) and hasattr(out, "_standin_gpu")):  # in place: keeps its own
                    tag(out, device_of(source))
        else:
            tag(out, target, placed=True)
        return out


# ---- torch.cuda, faked: a node of GPUS GPUs ----------------------------------------------------------------------
class FakeStream:
    def __init__(self, device: object = None, priority: int = 0, **_: object) -> None:
        self.device = torch.device("cuda", gpu_index(device))

    def wait_stream(self, other: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def record_event(self, event: object = None) -> "FakeEvent":
        return event or FakeEvent()

    def synchronize(self) -> None:
        REC.touch(self.device.index, "Stream.synchronize")

    def query(self) -> bool:
        return True

    def is_capturing(self) -> bool:
        return False


class FakeEvent:
    def __init__(self, *_: object, **__: object) -> None:
        pass

    def record(self, stream: object = None) -> None:
        pass

    def wait(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: object) -> float:
        return 0.0


class FakeDevice:
    """torch.cuda.device(d): the current device inside the block (cudaSetDevice, per thread)."""

    def __init__(self, device: object) -> None:
        self.index = None if device is None or device == -1 else gpu_index(device)

    def __enter__(self) -> None:
        self.previous = REC.current()
        if self.index is not None:
            REC.local.device = self.index

    def __exit__(self, *exc: object) -> None:
        REC.local.device = self.previous


def set_device(device: object) -> None:
    index = gpu_index(device)
    if not 0 <= index < GPUS:
        raise RuntimeError(f"CUDA error: invalid device ordinal (set_device({device!r}) with {GPUS} GPUs)")
    REC.local.device = index
    REC.add(kind="set_device", device=index)


def touching(what: str, result: object = None):
    def fake(device: object = None, *_: object, **__: object) -> object:
        REC.touch(gpu_index(device), what)
        return result
    return fake


_streams: dict[int, FakeStream] = {}


def current_stream(device: object = None) -> FakeStream:
    index = gpu_index(device)
    return _streams.setdefault(index, FakeStream(index))


CUDA = dict(
    is_available=lambda: True, device_count=lambda: GPUS, set_device=set_device, current_device=REC.current,
    device=FakeDevice, synchronize=touching("synchronize"), max_memory_allocated=touching("max_memory_allocated", 0),
    reset_peak_memory_stats=touching("reset_peak_memory_stats"), memory_allocated=touching("memory_allocated", 0),
    get_device_properties=lambda device=None: SimpleNamespace(name="stand-in GPU", total_memory=80 * 2 ** 30,
                                                               major=8, minor=0, multi_processor_count=108),
    get_device_name=lambda device=None: "stand-in GPU", get_device_capability=lambda device=None: (8, 0),
    is_bf16_supported=lambda *a, **k: True, get_rng_state_all=lambda: [], set_rng_state_all=lambda states: None,
    get_rng_state=lambda device="cuda": torch.zeros(16, dtype=torch.uint8),
    set_rng_state=lambda state, device="cuda": None,
    manual_seed_all=lambda seed: None, manual_seed=lambda seed: None, empty_cache=lambda: None,
    is_current_stream_capturing=lambda: False,
    Stream=FakeStream, Event=FakeEvent, current_stream=current_stream, default_stream=current_stream,
    stream=lambda stream=None: contextlib.nullcontext(),
)


# ---- torch.distributed: gloo underneath, nccl's choice of GPU recorded ------------------------------------------
def group_key(group: object) -> tuple[tuple[int, ...], str]:
    group = group if group is not None else c10d._get_default_group()
    backend = REC.backend_of.get(group, REC.default_backend)
    return tuple(dist.get_process_group_ranks(group)), backend


def barrier_gpu(ranks: tuple, device_ids: list | None) -> tuple[int, bool]:
    """The GPU ProcessGroupNCCL::barrier uses, and whether the caller named it (device_ids or a bound device)."""
    if device_ids:
        return int(device_ids[0]), True
    if REC.bound is not None:
        return REC.bound, True
    used = REC.used.get(ranks)
    if used:
        return min(used), False
    return dist.get_rank() % GPUS, False


def peer_rank(a: dict) -> int:
    """The global rank of a send/recv's peer, given as dst/src or (2.6 on) as group_dst/group_src."""
    for key in ("dst", "src"):
        if a.get(key) is not None:
            return int(a[key])
    group_peer = a.get("group_dst", a.get("group_src"))
    group = a.get("group") if a.get("group") is not None else c10d._get_default_group()
    return int(dist.get_global_rank(group, group_peer))


def record_collective(name: str, bound: inspect.BoundArguments) -> None:
    a = bound.arguments
    ranks, backend = group_key(a.get("group"))
    event = dict(kind="collective", op=name, group=list(ranks), backend=backend, device=None, named=True)
    if backend != "nccl":
        REC.add(**event)
        return
    if name == "barrier":
        event["device"], event["named"] = barrier_gpu(ranks, a.get("device_ids"))
    elif name.endswith("_object") or name.endswith("_object_list"):
        device = a.get("device")
        event["device"] = gpu_index(device) if is_gpu(device) else REC.current()
        event["named"] = is_gpu(device) or any(e.get("kind") == "set_device" for e in REC.events)
    else:
        tensor = first_tensor(*(v for k, v in a.items() if k not in ("group", "op")))
        event["device"] = device_of(tensor)
        event["named"] = event["device"] is not None
        if event["device"] is None:
            event["problem"] = "a CPU tensor on an nccl group (nccl: 'Tensors must be CUDA and dense')"
    if name in ("send", "recv", "isend", "irecv"):
        event["peer"] = peer_rank(a)
    if REC.bound is not None and event["device"] not in (None, REC.bound):
        event["problem"] = ("Attempt to perform collective on tensor not on device passed to init_process_group "
                            f"(bound to cuda:{REC.bound}, tensor on cuda:{event['device']})")
    if event["device"] is not None:
        REC.used.setdefault(ranks, []).append(event["device"])
        REC.touch(event["device"], f"nccl {name}")
    REC.add(**event)


def collective(name: str, real):
    signature = inspect.signature(real)

    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        depth = getattr(REC.depth, "n", 0)
        if depth == 0:
            record_collective(name, signature.bind_partial(*args, **kwargs))
            if name == "barrier":  # gloo takes no device_ids
                kwargs.pop("device_ids", None)
                args = args[:2]
        REC.depth.n = depth + 1
        try:
            return real(*args, **kwargs)
        finally:
            REC.depth.n = depth
    return wrapper


def batch_isend_irecv(real):
    @functools.wraps(real)
    def wrapper(p2p_op_list):
        if getattr(REC.depth, "n", 0) == 0:
            for op in p2p_op_list:
                name = getattr(op.op, "__name__", "p2p")
                fake = inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                          for n in ("tensor", "dst", "group", "group_dst")]).bind(
                    op.tensor, getattr(op, "peer", None), op.group, getattr(op, "group_peer", None))
                record_collective(name, fake)
        REC.depth.n = getattr(REC.depth, "n", 0) + 1
        try:
            return real(p2p_op_list)
        finally:
            REC.depth.n -= 1
    return wrapper


def init_process_group(real):
    signature = inspect.signature(real)

    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        a = signature.bind_partial(*args, **kwargs).arguments
        backend = str(a.pop("backend", None) or "nccl")
        REC.default_backend = "nccl" if backend in ("nccl", "cuda:nccl") else backend
        device_id = a.pop("device_id", None)
        a.pop("pg_options", None)
        if device_id is not None:
            REC.bound = gpu_index(device_id)
            REC.touch(REC.bound, "init_process_group(device_id=): the communicator is created now")
        REC.add(kind="init", backend=REC.default_backend, device_id=REC.bound)
        return real(backend="gloo", **a)
    return wrapper


def new_group(real):
    signature = inspect.signature(real)

    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        a = signature.bind_partial(*args, **kwargs).arguments
        asked = a.get("backend")
        a.pop("pg_options", None)
        a.pop("device_id", None)
        a["backend"] = None if asked in (None, "nccl") else asked
        group = real(**a)
        REC.backend_of[group] = str(asked) if asked else REC.default_backend
        return group
    return wrapper


def get_backend(real):
    @functools.wraps(real)
    def wrapper(group=None):
        return group_key(group)[1]
    return wrapper


def ddp_init(real):
    """DDP's collectives run in C++ (reducer.cpp, comm.cpp): recorded from the module's placement, by their rules."""
    signature = inspect.signature(real)

    @functools.wraps(real)
    def wrapper(self, *args, **kwargs):
        a = signature.bind_partial(self, *args, **kwargs).arguments
        module, group = a["module"], a.get("process_group")
        ranks, backend = group_key(group)
        params = [p for p in module.parameters() if p.requires_grad]
        gpus = [device_of(p) for p in params]
        buffers = [device_of(b) for b in module.buffers()]
        if backend == "nccl" and params:
            uses = [("ddp.verify_params", gpus[0])]
            uses += [("ddp.broadcast", d) for d in dict.fromkeys(gpus + buffers)]
            uses += [("ddp.allreduce_bucket", d) for d in reversed(list(dict.fromkeys(gpus)))]
            for op, d in uses:
                event = dict(kind="collective", op=op, group=list(ranks), backend=backend, device=d,
                             named=d is not None)
                if d is None:
                    event["problem"] = "a parameter or buffer left on the CPU under an nccl group"
                if REC.bound is not None and d not in (None, REC.bound):
                    event["problem"] = ("Attempt to perform collective on tensor not on device passed to "
                                        f"init_process_group (bound to cuda:{REC.bound}, DDP bucket on cuda:{d})")
                if d is not None:
                    REC.used.setdefault(ranks, []).append(d)
                REC.add(**event)
        REC.add(kind="ddp", group=list(ranks), device_ids=a.get("device_ids"), parameter_gpus=sorted(
            {d for d in gpus if d is not None}))
        return real(self, *args, **kwargs)
    return wrapper


TENSOR_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "gather",
                      "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all_single", "send", "recv",
                      "isend", "irecv", "barrier", "all_gather_object", "gather_object", "broadcast_object_list",
                      "send_object_list", "recv_object_list", "scatter_object_list")


# torch.accelerator (2.6 on), the device-generic face of the same calls, which the optimizers use from 2.14
ACCELERATOR = dict(
    is_available=lambda *a, **k: True, device_count=lambda: GPUS,
    current_accelerator=lambda *a, **k: torch.device("cuda"), current_device_index=REC.current,
    current_device_idx=REC.current, set_device_index=set_device, set_device_idx=set_device,
    current_stream=current_stream, synchronize=touching("synchronize"),
)


def install() -> None:
    import torch._dynamo  # noqa: F401  (its device table checks torch.cuda's real Stream and Event when first imported)
    for name, fake in CUDA.items():
        setattr(torch.cuda, name, fake)
    if hasattr(torch, "accelerator"):
        for name, fake in ACCELERATOR.items():
            if hasattr(torch.accelerator, name):
                setattr(torch.accelerator, name, fake)
    torch.Tensor.to, torch.Tensor.cuda = tensor_to, tensor_cuda
    torch.Tensor.record_stream = lambda self, stream: None  # also in a Pipe's worker threads
    torch.Tensor.pin_memory = lambda self, *a, **k: self
    import torch.distributed.device_mesh as device_mesh
    wrapped = {name: collective(name, getattr(c10d, name)) for name in TENSOR_COLLECTIVES if hasattr(c10d, name)}
    wrapped.update(init_process_group=init_process_group(c10d.init_process_group),
                   new_group=new_group(c10d.new_group), get_backend=get_backend(c10d.get_backend),
                   batch_isend_irecv=batch_isend_irecv(c10d.batch_isend_irecv))
    for name, fn in wrapped.items():
        original = getattr(c10d, name)
        for module in (dist, device_mesh, c10d):  # where torch's code reaches them (not device_mesh's own `reduce`)
            if getattr(module, name, None) is original:
                setattr(module, name, fn)
    from torch.nn.parallel import DistributedDataParallel
    DistributedDataParallel.__init__ = ddp_init(DistributedDataParallel.__init__)


def dump(out_dir: str) -> None:
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    record = {"torch": torch.__version__, "gpus": GPUS, "rank": rank,
              "node": int(os.environ.get("SLURM_NODEID", "0")), "local_rank": int(os.environ.get("SLURM_LOCALID", "0")),
              "events": REC.events}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f, indent=1)


def main() -> None:
    out, script, *argv = sys.argv[1:]
    install()
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    Placement().__enter__()
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        dump(out)
    sys.exit(code)


if __name__ == "__main__":
    main()
