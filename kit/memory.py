"""Memory: will a split fit? Weights, AdamW state, DDP buckets, the micro-batches in flight, activations per
precision and checkpointing, ZeRO, per part and per stage, term by term (docs/memory.md; MemTracker holds it).
Owns: the memory model, ARCHS (each GPU's usable memory). Imports: kit.arguments, kit.plan, kit.schedules.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from kit.arguments import PRECISIONS, Training
from kit.plan import part_contents, part_sizes
from kit.schedules import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, most_alive, schedule,
                           split_backward)


# What one GPU holds at the worst moment of a training step (the peak), in bytes, from the model arguments alone,
# for the model of bench_ddp_transformer.py: each part of a replica (the page's layout: a GPipe Pipe, then DDP) and
# each task of the stage layout (bench_stage.py: torch.distributed.pipelining). docs/memory.md has the model, its
# sources and its validation: benchmarks/memory_grid.py against torch's MemTracker on the CPU,
# benchmarks/memory_gpu.py against torch.cuda.max_memory_allocated on a GPU.
#
# The step is replayed op by op on a tape (_Tape): every op's outputs are allocated while its inputs are alive, then
# what it consumed is freed, as autograd releases it. One Layer's forward and backward, the Encoder's and the
# Decoder's are written out from torch's sources (nn.TransformerEncoderLayer, F.multi_head_attention_forward,
# tools/autograd/derivatives.yaml) and measured op by op on torch 2.13; a part's step is then composed from them:
#   forward   every micro-batch's forward (GPipe, checkpoint="never": all `chunks` stay alive until their backward);
#             the peak is in the last micro-batch's last block;
#   backward  micro-batches in reverse, each through the part's blocks from the last: the first one back fills the
#             weight gradients as it goes, while the other micro-batches' saved tensors are still alive; the second
#             one finds every gradient there and adds to it;
#   step      AdamW after backward: gradients, states, and its own temporary (CUDA's foreach path: sqrt of every
#             exp_avg_sq of the device at once, torch/optim/adam.py _multi_tensor_adam; the CPU's per tensor path:
#             two tensors of the largest parameter).
# The peak is the largest of these moments. The terms at that moment:
#   params, optimizer   fp32 weights (autocast keeps them: they are the master copy) and AdamW's exp_avg, exp_avg_sq;
#             under --zero the worst rank's share, partitioned as ZeroRedundancyOptimizer does (_partition_parameters)
#   buckets   DDP's gradient buckets, a copy of the gradients (gradient_as_bucket_view=False, reducer.cpp)
#   buffers, inputs   the positional table (and the stage layout's receive buffers); the batch's token ids (first
#             part) and labels (last part)
#   grads     the weight gradients filled so far (fp32)
#   activations   what autograd saved for the backward, of every micro-batch alive
#   weight_copies   under bf16/fp16 autocast, the low-precision copy of each matmul weight saved, per micro-batch
#   recompute     under --activation-checkpointing, the recomputed Layer's saved tensors
#   transient     what the running op holds besides (gradients in flight, temporaries), and what is kept past its
#                 use (fairscale's last task, the stage layout's input gradients and sends not yet waited for)
#   allowance     CUDA context, cuBLAS/NCCL workspaces, the caching allocator's slack: stated, not measured
#                 (ALLOWANCE_GIB plus ALLOWANCE_FRACTION of the rest); a tracker measures everything else
# Kernels, by `arch` (assumptions read in torch's sources, checked on a GPU only by benchmarks/memory_gpu.py):
#   - attention (attention_kernel): "sm80" (A100, H100) runs FlashAttention-2 for bf16/fp16 and the
#     memory-efficient kernel for fp32; "sm70" (V100: no flash, sdp_utils.cpp check_flash_attention_hardware_support
#     wants sm80) the memory-efficient kernel for all; a head_dim it can't take (not a multiple of 8, or above 256)
#     falls to the math path. cuDNN attention, first in some releases on sm90, refuses the layout
#     F.multi_head_attention_forward gives q, k, v (views of the packed projection: check_cudnn_layout), so MHA
#     never takes it. Flash lays its output out like q, so MHA's reshape of it is a view; the memory-efficient kernel
#     writes (B, S, H, D), so the reshape copies it and both copies are kept (the kernel's for its backward,
#     out_proj's input for its own). Neither keeps a dropout mask (the kernels regenerate it from a seed).
#     "cpu": the CPU flash kernel without dropout; with dropout the math path (q, k scaled copies, the full softmax,
#     the mask and the dropped weights, in fp32 under autocast too: attention.cpp upcasts half inputs on the CPU).
#   - dropout: CUDA's fused native_dropout keeps a bool mask; the CPU keeps a mask in the input's dtype
#     (aten/src/ATen/native/Dropout.cpp, is_fused_kernel_acceptable).
#   - fairscale's Pipe (measured on the CPU, read in fairscale 0.4.13): a worker thread keeps the task it ran last,
#     with its input and output, until the next one comes (_worker_holds); fairscale's Copy of a gradient back to the
#     part before runs after everything else that is ready (its node is built in the main thread, whose autograd
#     sequence numbers are the lowest), so a later micro-batch's backward finds the first one's input gradient still
#     there.
#   - gradient accumulation (traced): autograd adds a gradient into one already waiting in place when it holds the
#     only reference (torch/csrc/autograd/input_buffer.cpp), and at::linear adds the bias in place; under any
#     TorchDispatchMode (MemTracker is one) both go out of place (isTensorSubclassLike is true when a dispatch mode
#     is on: measured on torch 2.3.1 to 2.14.1). traced=True models the step as such a tracker sees it.

ALLOWANCE_GIB = 1.0

ALLOWANCE_FRACTION = 0.10

GIB = 2 ** 30

ARCHS = ("sm80", "sm70", "cpu")  # A100/H100 class, V100 class, the CPU


def arch_of(capability: tuple[int, int] | None) -> str:
    """The ARCHS key of a CUDA compute capability (None: the CPU). sm80 and later have bf16 and FlashAttention; the
    trainers, the GPU benchmarks and the checker's -C reading (V100: sm70) share it."""
    return "cpu" if capability is None else "sm80" if tuple(capability) >= (8, 0) else "sm70"


def requested_arch(v100: bool) -> tuple[str, str]:
    """The ARCHS key and the low precision (bf16, or fp16 where there is none) of the GPUs a request gets, read
    from -C or the partition: a V100 is compute capability 7.0, the A100 and H100 8.0 and 9.0 (arch_of)."""
    arch = arch_of((7, 0) if v100 else (8, 0))
    return arch, "bf16" if arch == "sm80" else "fp16"


class NotEstimated(ValueError):
    """A split the memory model does not cover (said as such: no figure rather than a wrong one)."""


@dataclass
class PartMemory:
    """Bytes one GPU (a part of a replica, or a task of the stage layout) holds at the peak of a training step."""
    part: int
    contents: str
    params: int = 0
    optimizer: int = 0
    buckets: int = 0
    buffers: int = 0
    inputs: int = 0
    grads: int = 0
    activations: int = 0
    weight_copies: int = 0
    recompute: int = 0
    transient: int = 0
    allowance: int = 0
    per_micro_batch: int = 0  # what one micro-batch leaves saved (activations and weight copies)
    alive: int = 0  # micro-batches alive at once at most
    peak_at: str = ""  # where in the step the peak falls
    unit: str = "part"  # "part" of a replica, or "task" of the stage layout

    TERMS = ("params", "optimizer", "buckets", "buffers", "inputs", "grads", "activations", "weight_copies",
             "recompute", "transient", "allowance")

    @property
    def peak(self) -> int:
        """The peak without the allowance: what a memory tracker of the step measures."""
        return self.total - self.allowance

    @property
    def total(self) -> int:
        return sum(getattr(self, n) for n in self.TERMS)

    def breakdown(self) -> dict[str, float]:
        """GiB per term, the non-zero ones, for messages and --json."""
        return {n: round(getattr(self, n) / GIB, 3) for n in self.TERMS if getattr(self, n)}


def _layer_params(d: int, dh: int) -> list[int]:
    """nn.TransformerEncoderLayer's parameters in registration order: in_proj w/b, out_proj w/b, linear1 w/b,
    linear2 w/b, norm1 w/b, norm2 w/b."""
    return [3 * d * d, 3 * d, d * d, d, dh * d, dh, d * dh, d, d, d, d, d]


def _replica_params(model: dict, nb_part: int) -> list[tuple[int, int]]:
    """(elements, part) of every parameter of a replica, in model.parameters() order."""
    d, dh = model["d_model"], model["d_hid"]
    layer_part = [p for p, n in enumerate(part_sizes(model["nlayers"], nb_part)) for _ in range(n)]
    out = [(model["vocab_size"] * d, 0)]  # Encoder: the embedding table
    for part in layer_part:
        out += [(n, part) for n in _layer_params(d, dh)]
    out += [(n, nb_part - 1) for n in (dh * d, dh, 2 * dh, 2)]  # Decoder: Linear(d, dh), ReLU, Linear(dh, 2)
    return out


def part_params(model: dict, layers: int, first: bool, last: bool) -> tuple[int, int]:
    """Elements of a part holding `layers` Layers (plus the Encoder, the Decoder), and of its largest parameter."""
    d, dh = model["d_model"], model["d_hid"]
    layer = _layer_params(d, dh)
    sizes = ([model["vocab_size"] * d] if first else []) + ([max(layer)] if layers else []) + ([dh * d] if last else [])
    numel = ((model["vocab_size"] * d if first else 0) + layers * sum(layer)
             + (dh * d + dh + 2 * dh + 2 if last else 0))
    return numel, max(sizes, default=0)


@functools.lru_cache(maxsize=1024)
def _stage_zero(d: int, dh: int, vocab: int, layers: int, first: bool, last: bool, replicas: int) -> int:
    """The most elements one rank of a stage's dp group owns under ZeroRedundancyOptimizer."""
    params = (([vocab * d] if first else []) + _layer_params(d, dh) * layers
              + ([dh * d, dh, 2 * dh, 2] if last else []))
    return _zero_owned(tuple((n, 0) for n in params), 1, replicas)[0]


def _zero_shares(params: list[tuple[int, int]], nb_part: int, replicas: int) -> list[int]:
    """Per part, the most parameter elements any one rank owns there under ZeroRedundancyOptimizer."""
    return list(_zero_owned(tuple(params), nb_part, replicas))


@functools.lru_cache(maxsize=1024)
def _zero_owned(params: tuple[tuple[int, int], ...], nb_part: int, replicas: int) -> tuple[int, ...]:
    sizes, owned = [0] * replicas, [[0] * nb_part for _ in range(replicas)]
    for numel, part in sorted(params, key=lambda p: p[0], reverse=True):  # stable, like torch's sorted()
        rank = sizes.index(min(sizes))
        sizes[rank] += numel
        owned[rank][part] += numel
    return tuple(max(owned[r][p] for r in range(replicas)) for p in range(nb_part))


def attention_kernel(arch: str, precision: str, head_dim: int, dropout: float) -> str:
    """The scaled_dot_product_attention kernel a Layer's attention runs: "flash", "efficient" or "math" (see the
    kernels above; aten/src/ATen/native/transformers/cuda/sdp_utils.cpp and sdp_utils_cpp.cpp)."""
    if arch == "cpu":
        return "math" if dropout > 0 else "flash"  # the CPU flash kernel refuses dropout (check_for_dropout)
    if head_dim % 8 or head_dim > 256:
        return "math"
    return "flash" if arch == "sm80" and precision != "fp32" else "efficient"


class _Tape:
    """Bytes alive while one block of the model runs, op by op: an op's outputs are allocated while its inputs are
    alive, then what it consumed is freed. `peak` is the most alive at once, `at_peak` what was alive then. With
    save=False (a checkpointed forward) the tensors autograd would save are freed at their last use (`done`)."""

    def __init__(self, save: bool = True, traced: bool = False, **alive: int) -> None:
        self.save, self.traced = save, traced
        self.alive = dict(alive)
        self.now = sum(alive.values())
        self.peak, self.at_peak = self.now, dict(alive)

    def op(self, *free: str | None, done: tuple[str, ...] = (), **new: int) -> None:
        self.alive.update(new)
        self.now += sum(new.values())
        if self.now > self.peak:
            self.peak, self.at_peak = self.now, dict(self.alive)
        for name in free + (() if self.save else done):
            if name is not None:
                self.now -= self.alive.pop(name)

    def rename(self, old: str, new: str) -> None:
        self.alive[new] = self.alive.pop(old)

    def add(self, old: str, new: str, into: str) -> None:
        """autograd adds gradient `new` to `old` waiting in an input buffer: in place, or out of place when traced."""
        if self.traced:
            self.op(old, new, sum_=self.alive[old])
            self.rename("sum_", into)
        else:
            self.op(new)
            self.rename(old, into)

    def wgrad(self, name: str, low: int, numel: int) -> None:
        """A weight's gradient as its matmul computes it: in the compute dtype (`low` bytes an element), or fp32."""
        self.op(**{f"new_{name}": (low or 4) * numel})

    def keep(self, name: str, low: int, numel: int, mode: str) -> None:
        """Then cast to fp32 under autocast, and kept (mode "steal": the first micro-batch back), added to the one
        waiting in autograd's input buffer ("add": micro-batches sharing one backward) or added in place by
        AccumulateGrad ("add_": one backward per micro-batch)."""
        if low:
            self.op(f"new_{name}", **{f"f32_{name}": 4 * numel})
            self.rename(f"f32_{name}", f"new_{name}")
        if mode == "steal":
            self.rename(f"new_{name}", f"grad_{name}")
        elif mode == "add":
            self.add(f"grad_{name}", f"new_{name}", f"grad_{name}")
        else:
            self.op(f"new_{name}")

    def grad(self, name: str, low: int, numel: int, mode: str) -> None:
        self.wgrad(name, low, numel)
        self.keep(name, low, numel, mode)


@dataclass(frozen=True)
class _Dims:
    """What one block's tape depends on, for one micro-batch."""
    n: int  # tokens of a micro-batch
    nb: int  # samples of a micro-batch
    seq: int
    d: int
    dh: int
    h: int
    vocab: int
    a: int  # bytes of the compute dtype: 4 (fp32) or 2 (bf16, fp16 autocast)
    drop: bool
    cpu: bool
    attn: str  # attention_kernel()
    traced: bool

    def mask(self, elements: int, dtype: int) -> int:
        return elements * (dtype if self.cpu else 1)

    def tape(self, save: bool = True, **alive: int) -> _Tape:
        return _Tape(save, self.traced, **alive)


def _attention_forward(z: _Dims, t: _Tape) -> str:
    """scaled_dot_product_attention as F.multi_head_attention_forward calls it (need_weights=False; q, k, v views of
    `qkv`), then the reshape of its output for out_proj, whose input it returns."""
    E, a, hs = z.d * z.n, z.a, z.h * z.seq * z.n
    if z.attn == "flash":  # logsumexp (B, H, S) fp32; the output reshaped is a view of itself
        t.op(done=("qkv", "lse"), att=a * E, lse=4 * z.h * z.n)
        return "att"
    if z.attn == "efficient":  # logsumexp padded to 32; the reshape copies the (B, S, H, D) output
        t.op(done=("qkv", "lse"), att=a * E, lse=4 * z.h * z.nb * -(-z.seq // 32) * 32)
        t.op(done=("att",), att2=a * E)
        return "att2"
    f = 4 if z.cpu else a  # the math path: fp32 on the CPU, q, k, v upcast under autocast
    up = f != a
    if up:
        t.op(q32=f * E)
        t.op(k32=f * E)
        t.op(v32=f * E)
    t.op(qs=f * E)  # a local of the math kernel until it returns; the scaled k a temporary of its matmul
    t.op(ks=f * E)
    t.op(done=("ks",), sc=f * hs)
    t.op("sc", sm=f * hs)
    if z.drop:
        t.op(mask=z.mask(hs, f))
        t.op(done=("mask", "sm"), ad=f * hs)
    if up:
        t.op(adc=a * hs)  # the attention weights cast back: returned, then dropped
    t.op(done=("ad" if z.drop else "sm", "v32" if up else "qkv", "qs"), o=f * E)
    if up:
        t.op("o", "q32", "k32", "adc", "qkv", oc=a * E)
        t.op("oc", att2=a * E)
    else:
        t.op("o", att2=a * E)
    return "att2"


def _layer_forward(z: _Dims, t: _Tape, keep_input: bool = False) -> None:
    """nn.TransformerEncoderLayer's forward (post-norm, ReLU, batch_first, training), under autocast when a < 4, on
    a tape holding its input x; leaves its output y, what autograd saves and (autocast) the weight copies. in_proj
    reads x transposed: for more than one sample that view is not contiguous and matmul copies it (the copy is
    saved), for one sample addmm reads x itself."""
    E, H, a, low = z.d * z.n, z.dh * z.n, z.a, z.a < 4
    x_saved = z.nb == 1 and not low
    if low:
        t.op(w_in=a * 3 * z.d * z.d, xc=a * E)
    if z.nb > 1:
        t.op(*(("xc",) if low else ()), xin=a * E)
    t.op(done=("xin" if z.nb > 1 else "xc" if low else None,), proj=a * 3 * E)
    if z.nb > 1 and z.traced:  # the bias added out of place (at::linear: in place but under a dispatch mode)
        t.op("proj", projb=a * 3 * E)
        t.rename("projb", "proj")
    t.op("proj", qkv=a * 3 * E)
    out = _attention_forward(z, t)
    if low:
        t.op(w_out=a * z.d * z.d)
    t.op(done=(out,), o1=a * E)
    _out_of_branch(z, t, "o1", "m1", "od1", "s1")
    t.op(done=("s1", "st1"), x1=4 * E, st1=8 * z.n)
    if low:
        t.op(w1=a * z.d * z.dh, x1c=a * E)
    t.op(done=("x1c",) if low else (), h1=a * H)
    t.op("h1", r=a * H)
    if z.drop:
        t.op(done=("m2", "r"), m2=z.mask(H, a), rd=a * H)
    if low:
        t.op(w2=a * z.d * z.dh)
    t.op(done=("rd" if z.drop else "r",), f=a * E)
    _out_of_branch(z, t, "f", "m3", "fd", "s2")
    t.op(done=("s2", "st2"), y=4 * E, st2=8 * z.n)
    # x1 and x are held by the Layer's frame (`x = self.norm2(x + ...)`) and its caller until it returns
    t.op("x1" if low else None, "x" if not x_saved and not keep_input else None,
         done=(() if low else ("x1",)) + (("x",) if x_saved and not keep_input else ()))


def _out_of_branch(z: _Dims, t: _Tape, out: str, mask: str, dropped: str, total: str) -> None:
    """A branch's output through its dropout (the mask saved) into the residual sum, fp32 like the residual."""
    if z.drop:
        t.op(out, done=(mask,), **{mask: z.mask(z.d * z.n, z.a), dropped: z.a * z.d * z.n})
        out = dropped
    t.op(out, **{total: 4 * z.d * z.n})


def _attention_backward(z: _Dims, t: _Tape) -> None:
    """From `ga`, the gradient of out_proj's input, to dq, dk, dv; the kernel's saved tensors freed."""
    E, a, hs = z.d * z.n, z.a, z.h * z.seq * z.n
    if z.attn == "flash":  # FA2 mha_bwd: dq, dk, dv, an fp32 dq accumulator and softmax_d, seq rounded to 128
        s128 = 0 if z.cpu else -(-z.seq // 128) * 128
        t.op(dq=a * E, dk=a * E, dv=a * E, acc=4 * z.nb * s128 * z.d, sd=4 * z.h * z.nb * s128)
        t.op("acc", "sd", "ga", "qkv", "att", "lse")
        return
    if z.attn == "efficient":  # dq, dk, dv in one (B, S, 3, H, D) chunk; delta; an fp32 dq accumulator (16 bits)
        t.op(dqkv=3 * a * E, sd=4 * z.h * z.nb * -(-z.seq // 32) * 32, acc=4 * E if a < 4 else 0)
        t.op("acc", "sd", "ga", "qkv", "att", "lse")
        return
    f = 4 if z.cpu else a
    up = f != a
    g = "ga"
    if up:
        t.op("ga", ga32=f * E)
        g = "ga32"
    t.op(gv=f * E)
    t.op(g, "v32" if up else "qkv", "ad" if z.drop else None, gad=f * hs)
    if z.drop:
        t.op("gad", "mask", gad2=f * hs)
    t.op("gad2" if z.drop else "gad", "sm", gsm=f * hs)
    t.op(gqs=f * E)
    t.op("gsm", "qs", "ks", gks=f * E)
    t.op("gqs", gq=f * E)
    t.op("gks", gk=f * E)
    t.op("gq", dq=a * E)
    t.op("gk", dk=a * E)
    t.op("gv", dv=a * E)


def _split_backward(z: _Dims, t: _Tape) -> None:
    """The backward of q, k, v = proj[0], proj[1], proj[2]: select_backward makes a zeros (3, S, B, E) for each, and
    autograd sums them; then the reshape back to in_proj's output layout copies."""
    a3 = 3 * z.a * z.d * z.n
    packed = "dqkv" in t.alive
    t.op(None if packed else "dq", z1=a3)
    t.op(None if packed else "dk", z2=a3)
    t.add("z1", "z2", "z12")
    t.op("dqkv" if packed else "dv", z3=a3)
    t.add("z12", "z3", "z123")
    t.op("z123", zc=a3)


def _layer_backward(z: _Dims, mode: str, ckpt: bool) -> _Tape:
    """One Layer's backward for one micro-batch: from what it saved and the gradient g of its output to the gradient
    gin of its input; weight gradients by `mode` (_Tape.grad). Under checkpointing (use_reentrant=False) the Layer's
    forward is first recomputed from the input kept, up to norm2's saved statistics (early stop), its output
    dropped."""
    E, H, a, low = z.d * z.n, z.dh * z.n, z.a, z.a < 4
    lp = _layer_params(z.d, z.dh)
    p = dict(in_proj=sum(lp[0:2]), out_proj=sum(lp[2:4]), linear1=sum(lp[4:6]), linear2=sum(lp[6:8]),
             norm1=sum(lp[8:10]), norm2=sum(lp[10:12]))
    lw = a if low else 0
    grads = {f"grad_{k}": 4 * v for k, v in p.items()} if mode != "steal" else {}
    t = z.tape(x=4 * E)
    if ckpt:
        t = z.tape(x=4 * E, g=4 * E, **grads)
        _layer_forward(z, t, keep_input=True)
    else:
        _layer_forward(z, t)
        t = z.tape(**t.alive, g=4 * E, **grads)
    t.op("y")
    t.op("g", "s2", "st2", gs2=4 * E)
    t.grad("norm2", 0, p["norm2"], mode)
    g = _into_branch(z, t, "gfc", "m3", "gfd")
    _linear_backward(t, "linear2", lw, p["linear2"], dict(gr=a * H), (g, "rd" if z.drop else None,
                                                                       "w2" if low else None), mode)
    if z.drop:
        t.op("gr", "m2", grr=a * H)
    t.op("grr" if z.drop else "gr", "r", gh=a * H)
    _linear_backward(t, "linear1", lw, p["linear1"], dict(gx1c=a * E),
                     ("gh", *(("x1c", "w1") if low else ("x1",))), mode)
    if low:
        t.op("gx1c", gx1f=4 * E)
    t.add("gs2", "gx1f" if low else "gx1c", "gx1")
    t.op("gx1", "s1", "st1", gs1=4 * E)
    t.grad("norm1", 0, p["norm1"], mode)
    g = _into_branch(z, t, "goc", "m1", "gdo")
    _linear_backward(t, "out_proj", lw, p["out_proj"], dict(ga=a * E),
                     (g, "att2" if z.attn != "flash" else None, "w_out" if low else None), mode)
    _attention_backward(z, t)
    _split_backward(z, t)
    _linear_backward(t, "in_proj", lw, p["in_proj"], dict(gx=a * E),
                     ("zc", "xin" if z.nb > 1 else "xc" if low else "x", "w_in" if low else None), mode)
    if low:
        t.op("gx", gxf=4 * E)
    t.add("gs1", "gxf" if low else "gx", "gin")
    if "x" in t.alive:  # the input kept by the checkpoint, released with the Layer's graph
        t.op("x")
    return t


def _into_branch(z: _Dims, t: _Tape, cast: str, mask: str, out: str) -> str | None:
    """The residual's gradient into a branch: cast to the branch's dtype under autocast, then through its dropout
    (the mask freed); returns the name of what the branch's last Linear gets (None: the residual's gradient)."""
    g = None
    if z.a < 4:
        t.op(**{cast: z.a * z.d * z.n})
        g = cast
    if z.drop:
        t.op(g, mask, **{out: z.a * z.d * z.n})
        g = out
    return g


def _linear_backward(t: _Tape, name: str, low: int, numel: int, grad_input: dict, free: tuple, mode: str) -> None:
    """A Linear's backward node: the input's gradient, the weight's, then its inputs and saved tensors freed."""
    t.op(**grad_input)
    t.wgrad(name, low, numel)
    t.op(*free)
    t.keep(name, low, numel, mode)


def _encoder_forward(z: _Dims, t: _Tape) -> None:
    """Encoder: embedding (fp32: autocast leaves it alone) + positions, dropout; output e."""
    E = 4 * z.d * z.n
    t.op(emb=E)
    t.op("emb", e=E)
    if z.drop:
        t.op("e", me=z.mask(E // 4, 4), ed=E)
        t.rename("ed", "e")


def _encoder_backward(z: _Dims, mode: str) -> _Tape:
    """embedding_dense_backward: a dense (vocab, d_model) fp32 gradient. CUDA first sorts the indices and sums per
    segment (aten/src/ATen/native/cuda/Embedding.cu, EmbeddingBackwardKernel.cu): int64 buffers of n and partial
    sums of up to n / 4 + min(n, vocab) rows, an assumption not measured here."""
    E, V = 4 * z.d * z.n, 4 * z.vocab * z.d
    t = z.tape(**({"me": z.mask(E // 4, 4)} if z.drop else {}), g=E, **({} if mode == "steal" else {"grad_emb": V}))
    if z.drop:
        t.op("g", "me", gd=E)
        t.rename("gd", "g")
    t.op(etmp=0 if z.cpu else 32 * z.n + 4 * z.d * (z.n // 4 + min(z.n, z.vocab)))
    t.op("etmp", "g", new_emb=V)
    t.keep("emb", 0, z.vocab * z.d, mode)
    return t


def _decoder_forward(z: _Dims, t: _Tape) -> None:
    """Decoder: mean over positions, Linear(d, dh), ReLU, Linear(dh, 2), on a tape holding its input y."""
    a, low, nb = z.a, z.a < 4, z.nb
    t.op(mean=4 * z.d * nb)
    if low:
        t.op("mean", wd1=a * z.d * z.dh, meanc=a * z.d * nb)
    t.op(hd=a * z.dh * nb)
    t.op("hd", rdec=a * z.dh * nb)
    if low:
        t.op(wd2=a * 2 * z.dh)
    t.op("y", logit=a * 2 * nb)  # its input held by the Decoder's frame until it returns


def _decoder_backward(z: _Dims, mode: str) -> _Tape:
    a, low, nb = z.a, z.a < 4, z.nb
    t = z.tape(y=4 * z.d * z.n)
    _decoder_forward(z, t)
    grads = {} if mode == "steal" else {"grad_dec1": 4 * (z.d * z.dh + z.dh), "grad_dec2": 4 * (2 * z.dh + 2)}
    t = z.tape(**{k: v for k, v in t.alive.items() if k != "logit"}, g=a * 2 * nb, **grads)
    t.op(grd=a * z.dh * nb)
    t.wgrad("dec2", a if low else 0, 2 * z.dh + 2)
    t.op("g", "wd2" if low else None)
    t.keep("dec2", a if low else 0, 2 * z.dh + 2, mode)
    t.op("grd", "rdec", ghd=a * z.dh * nb)
    t.op(gm=a * z.d * nb)
    t.wgrad("dec1", a if low else 0, z.d * z.dh + z.dh)
    t.op("ghd", *(("meanc", "wd1") if low else ("mean",)))
    t.keep("dec1", a if low else 0, z.d * z.dh + z.dh, mode)
    if low:
        t.op("gm", gmf=4 * z.d * nb)
    t.op("gmf" if low else "gm", gin=4 * z.d * z.n)  # mean's backward: the gradient expanded, divided: a full copy
    return t


_COPIES = ("w_in", "w_out", "w1", "w2", "wd1", "wd2")  # autocast's weight copies, by tape name

_OUTPUT = {"enc": "e", "layer": "y", "dec": "logit"}


def _terms(at: dict, saved: set, recomputed: bool = False) -> dict[str, int]:
    """A tape's snapshot by term: weight gradients, weight copies, saved activations (recomputed ones under
    checkpointing), and the rest, the transient."""
    out = dict(grads=0, weight_copies=0, activations=0, recompute=0, transient=0)
    for name, n in at.items():
        key = ("grads" if name.startswith("grad_") else "weight_copies" if name in _COPIES
               else ("recompute" if recomputed and name != "x" else "activations") if name in saved else "transient")
        out[key] += n
    return out


def _add(*parts: tuple[int, dict]) -> dict[str, int]:
    """Sum of term dicts, each scaled: _add((2, a), (1, b))."""
    out: dict[str, int] = {}
    for k, terms in parts:
        for name, n in terms.items():
            out[name] = out.get(name, 0) + k * n
    return out


@functools.lru_cache(maxsize=4096)
def _forward(kind: str, z: _Dims, ckpt: bool) -> dict:
    """One block (Encoder, a Layer, the Decoder) forward for one micro-batch: its peak (`fw`), what it leaves until
    the part's forward ends (`kept`: under checkpointing autocast's weight copies too), what it leaves for the
    backward (`saved`), as term dicts, and the names autograd saves (`names`)."""
    ckpt = ckpt and kind == "layer"  # --activation-checkpointing wraps each Layer only
    start = {"x": 4 * z.d * z.n} if kind == "layer" else {"y": 4 * z.d * z.n} if kind == "dec" else {}
    forward = {"enc": _encoder_forward, "layer": _layer_forward, "dec": _decoder_forward}[kind]
    full = z.tape(**start)
    forward(z, full)
    fw = full
    if ckpt:  # nothing saved but the input; the weight copies stay in autocast's cache until the part returns
        fw = z.tape(save=False, **start)
        forward(z, fw)
    kept = {k: v for k, v in fw.alive.items() if k != _OUTPUT[kind]}
    saved = {"x": 4 * z.d * z.n} if ckpt else kept
    kept = {**kept, **saved}  # checkpointed: its input, kept by the checkpoint
    names = set(saved)
    return dict(fw=_terms(fw.at_peak, names), kept=_terms(kept, names), saved=_terms(saved, names),
                names=frozenset(full.alive) | {"x"})


@functools.lru_cache(maxsize=4096)
def _backward(kind: str, z: _Dims, ckpt: bool, mode: str) -> tuple[dict, int]:
    """One block's backward for one micro-batch, gradients by `mode`: its peak as terms, and its weight gradients."""
    ckpt = ckpt and kind == "layer"
    t = (_layer_backward(z, mode, ckpt) if kind == "layer" else
         _encoder_backward(z, mode) if kind == "enc" else _decoder_backward(z, mode))
    grads = sum(n for k, n in t.alive.items() if k.startswith("grad_"))
    return _terms(t.at_peak, _forward(kind, z, ckpt)["names"], recomputed=ckpt), grads


@functools.lru_cache(maxsize=4096)
def _stack(z: _Dims, ckpt: bool, layers: int, first: bool, last: bool, later: str) -> dict:
    """A part's blocks (Encoder if first, `layers` Layers, Decoder if last) for one micro-batch, as term dicts
    relative to what the other micro-batches hold: `mb` what one leaves saved, `fw` its forward's peak, `bw0` the
    peak of the first micro-batch back (gradients filled as it goes), `bw1` of a later one (gradients all there,
    added to by mode `later`), and `grads` the part's weight gradients. Layers are identical, so of the Layers only
    the first and the last back can hold the peak: nothing here grows with the number of Layers."""
    kinds = (["enc"] if first else []) + (["layer"] if layers else []) + (["dec"] if last else [])
    if not kinds:  # a part with no block (nlayers < nb_part: refused by the checks, still estimated)
        zero = dict.fromkeys(("mb", "fw", "bw0", "bw1"), {})
        return dict(zero, grads=0, size=dict.fromkeys(zero, 0))
    count = {"enc": 1, "layer": layers, "dec": 1}
    fwd = {k: _forward(k, z, ckpt) for k in kinds}
    bwd = {(k, mode): _backward(k, z, ckpt, mode) for k in kinds for mode in ("steal", later)}
    g = {k: bwd[k, "steal"][1] for k in kinds}
    grads = sum(count[k] * g[k] for k in kinds)
    fw, bw0, bw1, before_fw, before_bw = [], [], [], [], []  # before_*: (k, terms) the blocks before hold
    for i, k in enumerate(kinds):
        n = count[k] - 1  # blocks of this kind before the last of them
        fw.append(_add(*before_fw, (n, fwd[k]["kept"]), (1, fwd[k]["fw"])))
        after = sum(count[kk] * g[kk] for kk in kinds[i + 1:])
        for j in {0, n}:  # this kind's block j: j of its kind before it, n - j after it
            bw0.append(_add(*before_bw, (j, fwd[k]["saved"]), (1, {"grads": after + (n - j) * g[k]}),
                            (1, bwd[k, "steal"][0])))
        bw1.append(_add(*before_bw, (n, fwd[k]["saved"]), (1, {"grads": grads - g[k]}), (1, bwd[k, later][0])))
        before_fw.append((count[k], fwd[k]["kept"]))
        before_bw.append((count[k], fwd[k]["saved"]))
    largest = lambda moments: max(moments, key=lambda terms: sum(terms.values()))  # noqa: E731
    out = dict(mb=_add(*before_bw), fw=largest(fw), bw0=largest(bw0), bw1=largest(bw1))
    return dict(out, grads=grads, size={k: sum(v.values()) for k, v in out.items()})


def _dims(model: dict, t: "Training", micro: int, arch: str, traced: bool) -> _Dims:
    d, h, drop = model["d_model"], model["n_head"], model.get("dropout", 0.0)
    return _Dims(n=micro * model["seq_len"], nb=micro, seq=model["seq_len"], d=d, dh=model["d_hid"], h=h,
                 vocab=model["vocab_size"], a=4 if t.precision == "fp32" else 2, drop=drop > 0, cpu=arch == "cpu",
                 attn=attention_kernel(arch, t.precision, d // max(h, 1), drop), traced=traced)


def _step_temporary(largest: int, owned: int, arch: str) -> int:
    """AdamW's temporaries in its step: on CUDA the foreach path's sqrt of all exp_avg_sq of the device (the
    `owned` elements), on the CPU the per-tensor path's sqrt and quotient of the largest parameter."""
    return 8 * largest if arch == "cpu" else 4 * owned


def _check_model(model: dict, t: "Training", arch: str) -> None:
    if t.precision not in PRECISIONS:
        raise ValueError(f"precision {t.precision!r} is not one of {', '.join(PRECISIONS)}")
    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r} is not one of {', '.join(ARCHS)}")
    if model["chunks"] < 1 or model["batch_size"] < model["chunks"]:
        raise ValueError(f"need 1 <= chunks <= batch_size, got chunks={model['chunks']}, "
                         f"batch_size={model['batch_size']}")


def _part_memory(part: int, contents: str, static: dict, moments: dict, s: dict, alive: int, arch: str,
                 unit: str = "part") -> PartMemory:
    """The moment with the most bytes alive: `moments` maps its name to [(count, key of s or a term dict)]."""
    def size(parts: list) -> int:
        return sum(k * (s["size"][x] if isinstance(x, str) else sum(x.values())) for k, x in parts)
    where = max(moments, key=lambda w: size(moments[w]))
    terms = _add((1, static), *((k, s[x] if isinstance(x, str) else x) for k, x in moments[where]))
    m = PartMemory(part, contents, per_micro_batch=s["size"]["mb"], alive=alive, peak_at=where, unit=unit,
                   **{k: v for k, v in terms.items() if k in PartMemory.TERMS})
    m.allowance = allowance(m.peak, arch)
    return m


def allowance(peak: int, arch: str) -> int:
    """The stated allowance over a GPU's peak: CUDA context, cuBLAS/NCCL workspaces, the caching allocator's slack;
    none on the CPU."""
    return 0 if arch == "cpu" else int(ALLOWANCE_GIB * GIB + ALLOWANCE_FRACTION * peak)


def _worker_holds(part: int, nb_part: int, io: int, arch: str, chunks: int) -> tuple[dict, dict]:
    """What fairscale's Pipe keeps of its last task: a worker thread holds the task it ran last and that task's
    output in its locals until the next task comes (fairscale/nn/pipe/worker.py), i.e. through the backward and the
    step, and the micro-batch before during a forward. On a GPU each device has its worker: every part keeps its
    last micro-batch's input (the first part's is the token ids, counted already) and output (`io` bytes each; the
    last part's is the logits). On the CPU one worker runs every part: the last part keeps its last input only.
    Returns the terms (through the backward, during the last forward)."""
    last = part == nb_part - 1
    if arch == "cpu":
        return {"transient": io if last and nb_part > 1 else 0}, {}
    return ({"transient": io * ((part > 0) + (not last))},
            {"transient": io if not last and chunks > 1 else 0})


@functools.lru_cache(maxsize=1024)
def _replica_zero(d: int, dh: int, vocab: int, nlayers: int, nb_part: int, replicas: int) -> tuple[int, ...]:
    model = dict(d_model=d, d_hid=dh, vocab_size=vocab, nlayers=nlayers)
    return _zero_owned(tuple(_replica_params(model, nb_part)), nb_part, replicas)


def estimate_memory(model: dict, t: "Training", nb_part: int, replicas: int, arch: str = "sm80",
                    traced: bool = False) -> list[PartMemory]:
    """Per part (GPU) of one replica of the page's layout, the bytes it holds at the peak of a training step (see
    the terms above). `model` holds nlayers, d_model, n_head, d_hid, seq_len, vocab_size, batch_size (per replica),
    chunks and dropout as the trainer resolves them; `arch` the kernels (ARCHS); `traced` the step as a
    TorchDispatchMode such as MemTracker sees it (benchmarks/memory_grid.py)."""
    _check_model(model, t, arch)
    if nb_part < 1 or replicas < 1:
        raise ValueError(f"need nb_part, replicas >= 1, got nb_part={nb_part}, replicas={replicas}")
    m, batch, seq = model["chunks"], model["batch_size"], model["seq_len"]
    z = _dims(model, t, -(-batch // m), arch, traced)
    zero = _replica_zero(model["d_model"], model["d_hid"], model["vocab_size"], model["nlayers"], nb_part,
                         replicas) if t.zero else None
    out = []
    for p, (layers, contents) in enumerate(zip(part_sizes(model["nlayers"], nb_part),
                                               part_contents(model["nlayers"], nb_part))):
        first, last = p == 0, p == nb_part - 1
        numel, largest = part_params(model, layers, first, last)
        owned = zero[p] if zero else numel
        static = dict(params=4 * numel, optimizer=8 * owned, buckets=4 * numel,
                      buffers=4 * seq * z.d if first else 0, inputs=8 * batch * ((seq if first else 0) + last))
        s = _stack(z, t.activation_checkpointing, layers, first, last, "add")
        held, previous = _worker_holds(p, nb_part, 4 * z.d * z.n, arch, m)
        moments = {"forward": [(m - 1, "mb"), (1, "fw"), (1, previous)],
                   "backward, first micro-batch back": [(m - 1, "mb"), (1, "bw0"), (1, held)],
                   "optimizer step": [(1, {"grads": s["grads"], "transient": _step_temporary(largest, owned, arch)}),
                                      (1, held)]}
        if m > 1:  # the gradient of the first one's input still waits here: fairscale's Copy runs last
            moments["backward, a later micro-batch"] = [(m - 2, "mb"), (1, "bw1"), (1, held),
                                                        (0 if first else 1, {"transient": 4 * z.d * z.n})]
        out.append(_part_memory(p, contents, static, moments, s, m, arch))
    return out


def _stage_static(model: dict, t: "Training", z: _Dims, s: int, stages: int, replicas: int,
                  layers: int) -> tuple[dict, int, int]:
    """A stage's weights, AdamW state (under --zero the worst rank's share over its dp group), DDP buckets, inputs
    and receive buffers: pipelining keeps one per micro-batch for the activation it receives and one for the
    gradient (PipelineStage._prepare_forward_infra, _prepare_backward_infra)."""
    first, last = s == 0, s == stages - 1
    numel, largest = part_params(model, layers, first, last)
    owned = (_stage_zero(z.d, z.dh, z.vocab, layers, first, last, replicas) if t.zero else numel)
    E, m = 4 * z.d * z.n, model["chunks"]
    # no DDP (so no buckets) under the zero-bubble schedules: bench_stage.py all-reduces their gradients itself
    static = dict(params=4 * numel, optimizer=8 * owned, buckets=0 if split_backward(t.schedule) else 4 * numel,
                  buffers=(4 * model["seq_len"] * z.d if first else 0) + m * E * ((not first) + (not last)),
                  inputs=8 * model["batch_size"] * ((model["seq_len"] if first else 0) + last))
    return static, owned, largest


def estimate_stage_memory(model: dict, t: "Training", pp: int, replicas: int, arch: str = "sm80",
                          traced: bool = False, torch: tuple[int, int] | None = None) -> list[PartMemory]:
    """Per task of one pipeline of the stage layout (bench_stage.py: a task per GPU, --pp tasks a pipeline, DDP over
    each stage's `replicas`), the bytes it holds at the peak of a step, its schedule replayed (kit.schedules). Each
    micro-batch's backward is its own autograd call there, so weight gradients are added in place after the first;
    a stage keeps each micro-batch's output until its backward (fwd_cache). The gradient of a stage's input is left
    on its receive buffer until the next step by torch 2.4 to 2.8 (_backward.py stage_backward); 2.13 and 2.14 drop
    it once sent (`val.grad = None`): releases in between, or `torch` unknown, are taken to keep it."""
    _check_model(model, t, arch)
    row = schedule(t.schedule)  # UnknownSchedule (a ValueError) for a name kit.schedules does not have
    virtual = row.stages_per_rank(t.virtual_stages)
    if pp < 1 or replicas < 1 or virtual < 1:
        raise ValueError(f"need pp, replicas, virtual stages >= 1, got pp={pp}, replicas={replicas}, "
                         f"schedule={t.schedule!r}, virtual={virtual}")
    m, stages = model["chunks"], pp * virtual
    z = _dims(model, t, -(-model["batch_size"] // m), arch, traced)
    sizes, contents = part_sizes(model["nlayers"], stages), part_contents(model["nlayers"], stages)
    # what a task keeps of each micro-batch after its backward: the gradient of a stage's input, left on its receive
    # buffer (torch <= 2.8); with several stages a task (2.13's _PipelineScheduleRuntime) every tensor it sent, the
    # sends waited for at the end of the step only (schedules.py: `while len(send_ops)`), 2.6 and 2.8 waited each
    retains = (torch is None or torch < (2, 13), virtual > 1 and (torch is None or torch >= (2, 13)))
    return [_stage_task(model, t, z, rank, pp, virtual, replicas, arch, sizes, contents, retains)
            for rank in range(pp)]


def replayed(t: "Training", pp: int, virtual: int, chunks: int, rank: int) -> list:
    """The actions task `rank` runs (kit.schedules), as this model replays them: forwards, full backwards (B), and
    the zero-bubble schedules' split ones (I, then W)."""
    return schedule(t.schedule).actions(pp, virtual, chunks, rank)


def _stash(z: _Dims, layers: int) -> int:
    """What the input backward (I) of one micro-batch leaves for its W on a stage: the gradient of each op's output
    that leads to a weight (_backward.py stage_backward_input: a pre-hook keeps each intermediate's gradient in its
    param_group until stage_backward_weight), per Layer: in_proj (3 d), out_proj, linear2 (d each) and linear1 (d_hid)
    in the compute dtype, the two LayerNorms' (d each) in fp32. The Decoder's few are left out."""
    return layers * z.n * ((5 * z.d + z.dh) * z.a + 2 * z.d * 4)


def _recomputed(z: _Dims, t: "Training", layers: int, last: bool) -> int:
    """Under --activation-checkpointing, what an I's recomputation leaves for its W: the Layers' tape as without
    checkpointing (autograd.grad with retain_graph=True keeps what the recomputed forward saved: _backward.py
    stage_backward_input), beyond the checkpoints themselves."""
    if not t.activation_checkpointing:
        return 0
    full, ckpt = (_stack(z, c, layers, False, last, "add_")["mb"] for c in (False, True))
    return sum(full.values()) - sum(ckpt.values())


_MOMENT = {FORWARD: "forward", BACKWARD: "backward", BACKWARD_INPUT: "input backward (I)",
           BACKWARD_WEIGHT: "weight backward (W)"}


def _stage_task(model: dict, t: "Training", z: _Dims, rank: int, pp: int, virtual: int, replicas: int, arch: str,
                sizes: list[int], contents: list[str], retains: tuple[bool, bool]) -> PartMemory:
    """One task of the stage layout: its stages' state, then its schedule replayed, the largest moment kept."""
    E, m, stages = 4 * z.d * z.n, model["chunks"], pp * virtual
    ids = schedule(t.schedule).stages(rank, pp, virtual)
    st, static, tmp = [], {}, 0
    for s in ids:
        one, owned, largest = _stage_static(model, t, z, s, stages, replicas, sizes[s])
        static = _add((1, static), (1, one))
        tmp = max(tmp, _step_temporary(largest, owned, arch))
        stack = _stack(z, t.activation_checkpointing, sizes[s], s == 0, s == stages - 1, "add_")
        kept = _add((1, stack["mb"]), (1, {"activations": E if s < stages - 1 else 0}))  # the output kept
        if s > 0 and (t.activation_checkpointing or (z.nb == 1 and z.a == 4)):
            kept["activations"] -= E  # the first Layer keeps its input: the receive buffer itself
        st.append(dict(stack, mb=kept, input_grad=E if s > 0 else 0, output=E if s < stages - 1 else 0,
                       stash=_stash(z, sizes[s]) if s > 0 else 0))
    size = [{key: sum(s[key].values()) for key in ("mb", "fw", "bw0", "bw1")} for s in st]
    alive, done, grads, held, held_bytes, best = [0] * virtual, [False] * virtual, 0, 0, 0, (-1, None)
    stashed = 0  # the split backward's gradients waiting for their W (_stash)
    actions = replayed(t, pp, virtual, m, rank)
    for i, (kind, _, stage) in enumerate(actions):
        k, back = ids.index(stage), kind != FORWARD
        # the zero-bubble schedules' split backward (_backward.py stage_backward_input/_weight): I runs the
        # backward to the input with retain_graph=True, the micro-batch's tape stays alive until its W, which ends
        # it as B does; the first stage's I runs nothing and its W the whole backward (stage.py)
        ends, sends = kind in (BACKWARD, BACKWARD_WEIGHT), kind in (BACKWARD, BACKWARD_INPUT)
        key = "bw1" if back and done[k] else "bw0" if back else "fw"
        mine = st[k]["grads"] if key == "bw1" and ends else 0  # bw1 holds this stage's gradients itself
        if kind == BACKWARD_INPUT and ids[k] == 0:
            continue
        # an I keeps its own stash as it goes back: at its moment, that of every Layer but the one running
        stashed -= st[k]["stash"] if kind == BACKWARD_WEIGHT else 0
        own = (_stash(z, max(0, sizes[ids[k]] - 1)) + _recomputed(z, t, sizes[ids[k]], ids[k] == stages - 1)
               if kind == BACKWARD_INPUT and ids[k] > 0 else 0)
        now = held_bytes - (size[k]["mb"] if back else 0) + size[k][key] + grads - mine + held + stashed + own
        if now > best[0]:
            counts = [alive[j] - (back and j == k) for j in range(virtual)]
            best = (now, (f"{_MOMENT[kind]} of stage {ids[k]}, step {i + 1}", st[k][key],
                          (counts, grads - mine, held + stashed + own)))
        stashed += st[k]["stash"] if kind == BACKWARD_INPUT else 0
        if ends:
            alive[k] -= 1
            held_bytes -= size[k]["mb"]
            grads += 0 if done[k] else st[k]["grads"]
            done[k] = True
        if sends:
            held = held + st[k]["input_grad"] if any(retains) else max(held, st[k]["input_grad"])
            held += st[k]["output"] if retains[1] else 0
        if kind == FORWARD:
            alive[k] += 1
            held_bytes += size[k]["mb"]
    where, rel, (counts, g, h) = best[1]
    moments = {where: [*((counts[j], st[j]["mb"]) for j in range(virtual)), (1, rel),
                       (1, {"grads": g, "transient": h})],
               "optimizer step": [(1, {"grads": grads, "transient": held + tmp})]}
    return _part_memory(rank, " | ".join(contents[s] for s in ids), static, moments,
                        dict(st[0], size={"mb": sum(st[0]["mb"].values())}),
                        most_alive(actions), arch, unit="task")


def worst_part(model: dict, t: "Training", nb_part: int, replicas: int, arch: str = "sm80",
               torch: tuple[int, int] | None = None) -> PartMemory:
    """The GPU that needs the most: the worst part of the replica layout, or the worst task of the stage layout
    (nb_part is then --pp; `torch` the release, which changes what the stage layout keeps)."""
    parts = (estimate_stage_memory(model, t, nb_part, replicas, arch, torch=torch) if t.layout == "stage"
             else estimate_memory(model, t, nb_part, replicas, arch))
    return max(parts, key=lambda m: m.total)


_worst = worst_part


def format_memory(parts: list[PartMemory], gpu_gib: float | None = None) -> str:
    """One line: the worst part, where its peak falls and its breakdown (GiB, or MiB below 1 GiB)."""
    worst = max(parts, key=lambda m: m.total)
    unit, size = ("GiB", GIB) if worst.total >= GIB else ("MiB", 2 ** 20)
    terms = " + ".join(f"{k} {getattr(worst, k) / size:.2f}" for k in PartMemory.TERMS
                       if getattr(worst, k) / size >= 0.005)
    room = f" of {gpu_gib:.1f} GiB" if gpu_gib else ""
    return (f"memory estimate: {worst.total / size:.2f} {unit}{room} on {worst.unit} {worst.part} ({worst.contents}), "
            f"peak at {worst.peak_at} = {terms}; activations {worst.per_micro_batch / size:.3f} {unit} per "
            f"micro-batch, {worst.alive} alive at most")


def memory_line(model: dict, t: "Training", nb_part: int, replicas: int, gpu_gib: float | None = None,
                arch: str = "sm80", torch: tuple[int, int] | None = None) -> str:
    """The trainers' start-up line: the estimate of their layout (nb_part is --pp in the stage layout)."""
    parts = (estimate_stage_memory(model, t, nb_part, replicas, arch, torch=torch) if t.layout == "stage"
             else estimate_memory(model, t, nb_part, replicas, arch))
    return format_memory(parts, gpu_gib)


def shared_gpu_memory(parts: list[PartMemory], devices: list[int] | None) -> tuple[int, list[int], int] | None:
    """The GPU that holds the most bytes when --devices puts several parts on it: (GPU, its parts, bytes)."""
    if not devices or len(set(devices)) == len(devices) or len(devices) != len(parts):
        return None
    per_gpu: dict[int, list[int]] = {}
    for part, gpu in enumerate(devices):
        per_gpu.setdefault(gpu, []).append(part)
    gpu, on_it = max(per_gpu.items(), key=lambda kv: sum(parts[p].total for p in kv[1]))
    total = sum(parts[p].total for p in on_it) - int((len(on_it) - 1) * ALLOWANCE_GIB * GIB)
    return gpu, on_it, total


def memory_fixes(model: dict, t: "Training", nb_part: int, replicas: int, tpn: int, gib: float,
                 v100: bool, torch: tuple[int, int] | None = None) -> list[str]:
    """The cheap fixes for a GPU that does not fit, each with its own new estimate (re-estimated, not scaled).
    nb_part is --pp in the stage layout."""
    arch, low = requested_arch(v100)
    worst_part = lambda *a: _worst(*a, torch=torch)  # noqa: E731
    stage = t.layout == "stage"
    tries: list[tuple[str, dict, Training, int, int]] = []
    if not t.activation_checkpointing:
        tries.append(("--activation-checkpointing", model, replace(t, activation_checkpointing=True), nb_part,
                      replicas))
    if t.precision == "fp32" and not (stage and low == "fp16"):  # the stage layout refuses fp16
        tries.append((f"--precision {low}", model, replace(t, precision=low), nb_part, replicas))
    if not stage and tpn % 2 == 0 and model["nlayers"] >= 2 * nb_part:
        tries.append((f"--ntasks-per-node={tpn // 2} (nb_part {2 * nb_part}, {replicas // 2} replicas)", model, t,
                      2 * nb_part, replicas // 2))
    lighter = schedule(t.schedule).lighter if stage else None  # a schedule that keeps fewer micro-batches alive
    if lighter and model["chunks"] >= nb_part:
        tries.append((f"--schedule {lighter} (at most --pp micro-batches alive)", model, replace(t, schedule=lighter),
                      nb_part, replicas))
    if not t.zero and replicas > 1:
        tries.append(("--zero", model, replace(t, zero=True), nb_part, replicas))
    out, fitting = [], []
    for label, m, tt, nb, r in tries:
        total = worst_part(m, tt, nb, r, arch).total / GIB
        out.append(f"{label}: {total:.1f} GiB" + ("" if total <= gib else " (still too big)"))
        fitting.append(total <= gib)
    chunks = model["chunks"]
    batch = next((b for b in range(model["batch_size"] - chunks, 0, -chunks)
                  if worst_part(dict(model, batch_size=b), t, nb_part, replicas, arch).total / GIB <= gib), None)
    if batch:
        est = worst_part(dict(model, batch_size=batch), t, nb_part, replicas, arch).total / GIB
        out.append(f"--batch-size {batch} (a multiple of --chunks {chunks}): {est:.1f} GiB")
    if not any(fitting) and not batch and tries:
        precision = low if t.precision == "fp32" and not (stage and low == "fp16") else t.precision
        all_t = replace(t, activation_checkpointing=True, precision=precision, zero=replicas > 1 or t.zero)
        est = worst_part(model, all_t, nb_part, replicas, arch).total / GIB
        out.append(f"all of --activation-checkpointing"
                   f"{f' --precision {precision}' if precision != t.precision else ''}"
                   f"{' --zero' if all_t.zero else ''} together: {est:.1f} GiB"
                   + ("" if est <= gib else " (still too big: use more GPUs per "
                      f"{'pipeline (--pp)' if stage else 'replica'} or a smaller model)"))
    return out
