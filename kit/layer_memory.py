"""The per-GPU peak of a user's model (issue 34): kit.memory's terms, composed from each layer's measured figures
(kit.own_model.LayerCost) instead of an op-by-op tape; the kit's own Transformer goes to kit.memory itself.
Owns: estimate_peaks, the composition of layer figures into a part's step, the trainers' loss on the last part's
output (LOSS_COPIES, issue 41). Imports: kit.arguments, kit.memory, kit.plan, kit.schedules.

The terms are kit.memory.PartMemory's, with its helpers (ZeRO's partition, AdamW's temporary, the allowance, the
stage layout's schedules). A layer is known by its figures alone (no torch here): its parameters (each tensor's
elements), its buffers, the bytes it saves for the backward per sample and per micro-batch (autocast's weight copies)
in each precision, its input and output per sample. What happens inside a layer's backward beyond its input's and
output's gradients is not known, and is not counted (docs/own_model.md says what that costs).
"""
from __future__ import annotations

from typing import Sequence

from kit.arguments import Training
from kit.memory import NotEstimated, PartMemory, _add, _step_temporary, _zero_owned, allowance, estimate_memory, \
    estimate_stage_memory, replayed
from kit.plan import layer_split
from kit.schedules import most_alive, schedule

LABEL_BYTES = 8  # one int64 class index a sample, on the last part (the kit's data; a synthetic batch's labels)

# The trainers' loss on the last part (kit.train.trainer.step_functions): kit.train.own.synthetic_loss,
# out.float().pow(2).mean(), on any output, or the kit's cross-entropy on 2 logits (a few bytes a sample: the same
# terms). Its backward holds, besides the output and its fp32 copy, LOSS_COPIES fp32 tensors of the output's size at
# once: mean's gradient (grad.expand(sizes) / numel, a new tensor) and pow_backward's grad * (2 * self.pow(1)), three
# more (torch/csrc/autograd/FunctionsManual.cpp pow_backward; derivatives.yaml mean).
LOSS_COPIES = 4


def kit_sizes(nlayers: int, nb_part: int) -> list[int]:
    """The kit's plan as sizes over the sequence Encoder, Layers, Decoder: the Encoder on the first part, the Decoder
    on the last (kit.plan.layer_split, the one split function the trainers run)."""
    return layer_split(nlayers + 2, nb_part, ends=True)


def one_stage_a_task(t: Training) -> None:
    """NotEstimated where the stage layout's schedule puts several stages of a --model on each task, which this
    estimate does not model yet."""
    stages = schedule(t.schedule).stages_per_rank(t.virtual_stages) if t.layout == "stage" else 1
    if stages > 1:
        raise NotEstimated(f"--schedule {t.schedule} puts {stages} stages of a --model on each task, which its "
                           "estimate does not model yet (one stage a task: --schedule gpipe or 1f1b)")


def estimate_peaks(costs: Sequence, sizes: Sequence[int], micro: int, chunks: int, precision: str = "fp32",
                   replicas: int = 1, zero: bool = False, checkpointing: bool = False, layout: str = "replica",
                   arch: str = "sm80", schedule: str = "1f1b", traced: bool = False,
                   kit_model: dict | None = None, loss: bool = True) -> list[PartMemory]:
    """Per part (a GPU of the replica layout, or a task of the stage layout, one stage a task), the bytes it holds
    at the peak of a training step, with its terms: `sizes` layers a part, micro-batches of `micro` samples,
    `chunks` of them a step, the trainers' loss on the last part's output (`loss`; False: the costs are not the
    model's last layers, as a layer's own peak for the split by memory). The kit's own Transformer (`kit_model`: its
    arguments, as kit.own_model recognises them) split as the kit splits it is kit.memory's estimate itself, to the
    byte."""
    if sum(sizes) != len(costs) or min(sizes) < 1 or micro < 1 or chunks < 1 or replicas < 1:
        raise ValueError(f"need parts of at least one layer covering the {len(costs)} layers, micro, chunks, "
                         f"replicas >= 1; got sizes={list(sizes)}, micro={micro}, chunks={chunks}")
    nb_part = len(sizes)
    t = Training(layout=layout, pp=nb_part, schedule=schedule, virtual_stages=1, precision=precision,
                 activation_checkpointing=checkpointing, zero=zero)
    if kit_model and list(sizes) == kit_sizes(kit_model["nlayers"], nb_part):
        model = dict(kit_model, batch_size=micro * chunks, chunks=chunks)
        if layout == "stage":
            return estimate_stage_memory(model, t, nb_part, replicas, arch, traced=traced)
        return estimate_memory(model, t, nb_part, replicas, arch, traced=traced)
    bounds = [sum(sizes[:p]) for p in range(nb_part + 1)]
    parts = [list(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
    owned = (_zero_owned(tuple((n, p) for p, part in enumerate(parts) for c in part for n in c.tensors), nb_part,
                         replicas) if zero and replicas > 1 else None)
    outs = [c.out_by_precision.get(precision, c.out_bytes) for c in costs]
    ins = [costs[0].saved_checkpointed, *outs[:-1]]  # per sample, in the precision the step runs
    return [_part(parts[p], p, nb_part, micro, chunks, t, owned[p] if owned else None, arch, traced,
                  _alive(t, nb_part, chunks, p), f"layers {bounds[p]}-{bounds[p + 1] - 1}",
                  (ins[bounds[p]:bounds[p + 1]], outs[bounds[p]:bounds[p + 1]]), loss) for p in range(nb_part)]


def _alive(t: Training, nb_part: int, chunks: int, rank: int) -> int:
    """Micro-batches forwarded and not yet backwarded at once, at most: every one in the replica layout (GPipe),
    the schedule's count in the stage layout (kit.schedules, as kit.memory replays it)."""
    if t.layout != "stage":
        return chunks
    return most_alive(replayed(t, nb_part, 1, chunks, rank))


def _micro_batch(costs: Sequence, ins: list[float], micro: int, precision: str, ckpt: bool,
                 first: bool) -> list[dict[str, float]]:
    """What each layer leaves saved for one micro-batch, as terms: activations (under checkpointing its input
    alone) and autocast's weight copies. The first part's first layer's input is the batch, counted in `inputs`."""
    out = []
    for i, c in enumerate(costs):
        batch_view = first and i == 0
        if ckpt:
            out.append(dict(activations=0.0 if batch_view else ins[i] * micro, weight_copies=0.0))
            continue
        # its input is the batch, or the layer before saved it as its own output (one storage, counted there)
        shared = (c.input_saved.get(precision, 0.0) if batch_view else
                  min(c.input_saved.get(precision, 0.0), costs[i - 1].output_saved.get(precision, 0.0)) if i else 0)
        out.append(dict(activations=(c.saved[precision] - shared) * micro, weight_copies=c.saved_fixed[precision]))
    return out


def _part(costs: list, p: int, nb_part: int, micro: int, chunks: int, t: Training, owned: int | None, arch: str,
          traced: bool, alive: int, contents: str, io: tuple[list[float], list[float]], loss: bool) -> PartMemory:
    """One part's step: static state, then the largest of its moments (kit.memory's): the last forward, the first
    micro-batch back (gradients filled as it goes), a later one (every gradient there, one added to), the step."""
    first, last, stage = p == 0, p == nb_part - 1, t.layout == "stage"
    numel = sum(sum(c.tensors) for c in costs)
    largest = max((n for c in costs for n in c.tensors), default=0)
    batch = micro * chunks
    # the stage layout's receive buffers: one a micro-batch for the input (not the first), for the gradient (not last)
    ins, outs = io
    recv = chunks * micro * ((not first) * ins[0] + (not last) * outs[-1]) * stage
    static = dict(params=4 * numel, optimizer=8 * (owned if owned is not None else numel), buckets=4 * numel,
                  buffers=sum(c.buffer_bytes for c in costs) + recv,
                  inputs=batch * (costs[0].saved_checkpointed if first else 0) + LABEL_BYTES * batch * last)
    mb = _micro_batch(costs, ins, micro, t.precision, t.activation_checkpointing, first)
    one = _add(*((1, m) for m in mb))
    grads = [4 * sum(c.tensors) for c in costs]
    moments: dict[str, list[tuple[int, dict]]] = {}
    for j, c in enumerate(costs):
        upto = _add(*((1, m) for m in mb[:j + 1]))
        first_back, later = _backward(c, ins[j] * (not first or j > 0), outs[j], micro, t, traced and not stage)
        moments[f"forward of layer {j} (last micro-batch)"] = [
            (alive - 1, one), (1, upto), (1, {"transient": outs[j] * micro})]
        moments[f"backward of layer {j}, first micro-batch back"] = [
            (alive - 1, one), (1, upto), (1, first_back), (1, {"grads": sum(grads[j + 1:])})]
        if alive > 1:  # every gradient there, the new one added to it: in autograd's input buffer (the replica
            # layout's one backward: out of place under a dispatch mode), or by AccumulateGrad (the stage layout's)
            moments[f"backward of layer {j}, a later micro-batch"] = [
                (alive - 2, one), (1, upto), (1, later), (1, {"grads": sum(grads)})]
    moments["optimizer step"] = [(1, {"grads": sum(grads), "transient": _step_temporary(
        largest, owned if owned is not None else numel, arch)})]
    if last and loss:
        _loss_moments(moments, costs[-1], len(costs) - 1, outs[-1], micro, chunks, alive, one, sum(grads), stage)
    where = max(moments, key=lambda w: sum(k * sum(x.values()) for k, x in moments[w]))
    terms = _add((1, static), *moments[where])
    m = PartMemory(p, contents, per_micro_batch=int(sum(one.values())), alive=alive, peak_at=where,
                   unit="task" if t.layout == "stage" else "part",
                   **{k: int(v) for k, v in terms.items() if k in PartMemory.TERMS})
    m.allowance = allowance(m.peak, arch)
    return m


def _backward(c: object, into: float, out: float, micro: int, t: Training, summed: bool) -> tuple[dict, dict]:
    """What layer `c`'s backward holds besides the saved tensors already counted, as terms, for the first
    micro-batch back (its weight gradients made) and for a later one (its largest weight's gradient made in the
    compute dtype, cast to fp32 (the low copy gone by then), added to the one there: out of place where `summed`, a
    tracer's autograd): the output's and the input's gradients, the recomputed tensors under checkpointing,
    autocast's low-precision copy of its largest weight's gradient. Its own temporaries are not known."""
    p, n = t.precision, max(c.tensors, default=0)
    redo = c.saved[p] * micro + c.saved_fixed[p] if t.activation_checkpointing else 0.0
    low = 2 * n * (p != "fp32")
    flowing = _flowing(into, out, micro, redo)
    return ({"recompute": redo, "grads": 4 * sum(c.tensors), "transient": flowing + low},
            {"recompute": redo, "transient": flowing + 4 * n + max(low, 4 * n * summed)})


def _flowing(into: float, out: float, micro: int, redone: float) -> float:
    """The gradients in flight through a layer's backward: its output's and its input's (none for the batch). Under
    checkpointing the input's gradient comes last, once what the layer recomputed (`redone`) is mostly freed: the
    larger of the two counts."""
    return out * micro + max(0.0, into * micro - redone)



def _loss_moments(moments: dict[str, list[tuple[int, dict]]], c: object, j: int, out: float, micro: int,
                  chunks: int, alive: int, one: dict, grads: float, stage: bool) -> None:
    """The last part's output and the trainers' loss on it (LOSS_COPIES), added to its moments: `out`, the model's
    output per sample in the step's precision (`c`, the last layer, the part's layer `j`). The replica layout's Pipe
    gathers the micro-batches' outputs into one batch (torch.cat) and the loss runs once on it: the earlier
    micro-batches' outputs wait for the gather during the forward; the gathered output (the trainer keeps it for the
    step's figures) and its gradient (the micro-batches' slices are views of it) live through the whole backward.
    The stage layout's schedule runs the loss on each micro-batch and keeps every output (PipelineStage.output_chunks,
    torch 2.4-2.13 stage.py) until the next step clears them, merged into one batch (merge_chunks: one more copy)
    after the last backward."""
    elems = 1
    for n in c.out_shape:
        elems *= n
    f32 = 4.0 * elems
    temps = (f32 if out < f32 else 0.0) + LOSS_COPIES * f32  # out.float() (a copy below fp32), then the backward's
    batch = micro * chunks
    for where, terms in moments.items():
        if where.startswith("forward") and not stage:
            terms.append((1, {"transient": (chunks - 1) * micro * out}))
        elif where.startswith("backward") and not stage:  # less the output's gradient _flowing counts (a slice)
            mine = micro * out if where.startswith(f"backward of layer {j},") else 0.0
            terms.append((1, {"transient": 2 * batch * out - mine}))
        elif where.startswith("backward"):  # the outputs kept so far
            terms.append((1, {"transient": (batch if "later" in where else alive * micro) * out}))
        elif stage:  # the optimizer step: the outputs kept
            terms.append((1, {"transient": batch * out}))
    if stage:
        moments["the loss of the last micro-batch"] = [(alive, one), (1, {"grads": grads * (chunks > 1)}),
                                                      (1, {"transient": batch * out + micro * temps})]
        moments["the outputs merged (merge_chunks)"] = [(1, {"grads": grads, "transient": 2 * batch * out})]
    else:
        moments["the loss over the gathered output"] = [(alive, one), (1, {"transient": batch * (out + temps)})]
