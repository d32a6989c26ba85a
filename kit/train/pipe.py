"""The page's Pipe engines: torch <= 2.3's torch.distributed.pipeline.sync.Pipe (with RPC) or fairscale's, chosen by
--engine, and PipeModel, the page's `Pipe(nn.Sequential(*module_list), chunks, checkpoint="never")` that DDP wraps
and that closes its worker threads (its holder closes it on every exit path: kit.train.replica.Replica). Imports:
kit.arguments, kit.releases, kit.train.errors.
"""
from __future__ import annotations

import gc
import tempfile
import threading
import warnings

import torch
import torch.nn as nn

import kit.arguments
import kit.releases
from kit.train.errors import RunError


# The page's Pipe, torch.distributed.pipeline.sync.Pipe, exists up to torch 2.3 (removed in 2.4); fairscale.nn.Pipe
# is the library it was upstreamed from, same GPipe and arguments, and runs on current torch. --engine picks one
# (auto: the page's where it exists); pick_engine() below says what to install when the chosen one is missing.
with warnings.catch_warnings():  # both announce their own deprecation on import: known, nothing to act on
    warnings.simplefilter("ignore")
    try:
        from torch.distributed.pipeline.sync import Pipe as TorchPipe
    except ImportError:  # torch >= 2.4
        TorchPipe = None
    try:
        from fairscale.nn import Pipe as FairscalePipe
    except ImportError:  # pip install --user fairscale
        FairscalePipe = None


def pick_engine(requested: str) -> str:
    """--engine auto|torch-pipe|fairscale to the engine that runs here, or one line saying what to install."""
    if requested == "torch-pipe" and TorchPipe is None:  # the line of kit.releases.TORCH_FEATURES
        missing = kit.releases.torch_refusals(torch.__version__, kit.arguments.Training(engine="torch-pipe"))
        raise RunError(missing[0] if missing else f"--engine torch-pipe: torch.distributed.pipeline.sync does not "
                       f"load in this torch {torch.__version__}; use --engine fairscale (or auto)")
    engine = ("torch-pipe" if TorchPipe is not None else "fairscale") if requested == "auto" else requested
    if engine == "fairscale" and FairscalePipe is None:
        raise RunError("--engine fairscale needs fairscale next to this torch: pip install --user fairscale"
                       + ("" if TorchPipe is None else ", or use --engine torch-pipe"))
    return engine


def init_rpc_for_pipe() -> tempfile.NamedTemporaryFile:
    """torch <= 2.3's Pipe needs RPC in the process, even alone: the page's per-process file:// store.
    _transports=["shm", "uv"] as on Jean Zay (no "ibv"); CUDA channels only where CUDA exists."""
    import torch.distributed.rpc as rpc
    tmpfile = tempfile.NamedTemporaryFile()
    channels = ["cuda_ipc", "cuda_basic", "basic"] if torch.cuda.is_available() else ["basic"]
    rpc.init_rpc(name="worker", rank=0, world_size=1, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
        init_method=f"file://{tmpfile.name}", _transports=["shm", "uv"], _channels=channels))
    return tmpfile


class PipeModel(nn.Sequential):
    """The page's `Pipe(nn.Sequential(*module_list), chunks, checkpoint="never")`.

    It *is* that nn.Sequential for DDP and for state_dict() (keys '0.0.embedding.weight', '1.3.linear1.bias',
    ... whatever the engine), and runs forward through the engine's Pipe, which shares its modules.
    checkpoint="never", as the page says, "so that it can work with DDP": the Pipe's checkpointing is reentrant
    (a nested backward over each part, once per micro-batch), and DDP refuses a parameter made ready twice in one
    step (measured: see CheckpointedLayer). The price is every micro-batch's activations, alive until its
    backward; --activation-checkpointing gets the saving back inside each Layer, in the way DDP supports.
    """

    def __init__(self, module_list: list[nn.Sequential], engine: str, chunks: int,
                 devices: list[str]) -> None:
        super().__init__(*module_list)
        before = set(threading.enumerate())
        if engine == "torch-pipe":
            pipe = TorchPipe(nn.Sequential(*module_list), chunks=chunks, checkpoint="never")
        else:
            with warnings.catch_warnings():  # "upstreamed to PyTorch": not on torch >= 2.4, it was removed
                warnings.simplefilter("ignore", DeprecationWarning)
                pipe = FairscalePipe(nn.Sequential(*module_list), balance=[1] * len(module_list), devices=devices,
                                     chunks=chunks, checkpoint="never")
        object.__setattr__(self, "pipe", pipe)  # not a registered child: parameters and keys stay ours
        self.engine = engine
        self.workers = [t for t in threading.enumerate() if t not in before]  # the Pipe's per-device threads

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.pipe(tokens)
        return out.local_value() if self.engine == "torch-pipe" else out  # torch's Pipe returns an RRef

    def close(self) -> None:
        """Stop the Pipe's worker threads now, before the interpreter exits.

        Both engines run one worker thread per device. fairscale stops them only in Pipeline.__del__, torch
        2.3 never (daemon threads). A worker keeps its last task in its frame, which keeps the pipeline alive,
        so __del__ never runs: at exit the process hangs, or a daemon worker still running when the interpreter
        finalises aborts it with "terminate called without an active exception" (seen with fairscale 0.4.13 on
        torch 2.13). None is the workers' own stop signal and (False, None) their last reply; then we join them."""
        pipe = self.__dict__.pop("pipe", None)
        pipeline = getattr(pipe, "pipeline", None)
        if pipeline is not None:
            for q in set(getattr(pipeline, "in_queues", [])):
                q.put(None)
            for q in set(getattr(pipeline, "out_queues", [])):
                while q.get(timeout=60) != (False, None):
                    pass
            pipeline.in_queues, pipeline.out_queues = [], []  # nothing left for fairscale's __del__ to join
        for t in self.workers:
            t.join(timeout=60)
        self.workers = []
        del pipe, pipeline
        gc.collect()
