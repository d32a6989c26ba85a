"""A user's model measured in a child process (issue 41): the checker and `python -m kit.own_model` run the model's
code (its file's import, its build function, its --sample function, each layer's forward) only in a child of their
own, bounded in time and memory, after one line on stderr that says what is run. Whatever the child does (exit,
os._exit, hang, crash, allocate, print) the parent answers a Model or one ModelError line; it never takes a
result it did not validate. The trainers measure in their own process (they run the model anyway): the child calls
the same kit.own_model.describe.

Owns: the bounds (MEASURE_SECONDS, MEASURE_GIB and their KIT_ variables, read in bounds()), describe_isolated (the
parent), child_main (the child's side: its program, CHILD, hands it kit.own_model.describe, so that kit.own_model may
use this module). Imports: kit.bounded, kit.model (no torch: the parent imports none).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from kit.bounded import FileProblem, printable, read_regular
from kit.model import Model, ModelError, costs_from_json

# The bounds of one measurement. Time: the kit plans each family it is held to in under 60 s on 2 cores (docs/
# own_model.md); five times that leaves room for a slow login node and still ends a model that hangs. Memory:
# fake tensors hold no data and a layer that needs a real run is built alone (kit.own_model.one_layer_for_real),
# so a measurement's address space is torch's own (one thread): 0.7 GiB with torch 2.13.0+cpu, 4.4 GiB with
# 2.8.0+cu128 (its CUDA libraries mapped, none used); 8 GiB refuses a build or a sample that allocates for real
# before it takes a login node's memory.
MEASURE_SECONDS = 300
MEASURE_GIB = 8
RESULT_BYTES = 64 * 2 ** 20  # the answer: a few KiB a layer
LOG_BYTES = 2 ** 20  # the child's stdout and stderr, read back for the kit's own lines only


def bounds() -> tuple[float, float]:
    """(seconds, GiB) of a measurement: MEASURE_SECONDS and MEASURE_GIB, or KIT_MEASURE_SECONDS and KIT_MEASURE_GIB
    where a user sets them (a model that takes longer, a layer measured for real that needs more); read here only."""
    out = []
    for name, default in (("KIT_MEASURE_SECONDS", MEASURE_SECONDS), ("KIT_MEASURE_GIB", MEASURE_GIB)):
        text = os.environ.get(name, "").strip()
        try:
            value = float(text) if text else float(default)
        except ValueError:
            value = -1.0
        if not 0 < value < 1e6:
            raise ModelError(f"{name}={text!r}: give a positive number (the default is {default}), or unset it")
        out.append(value)
    return out[0], out[1]


def what_runs(spec: str) -> str:
    """The announcement: which file (or module) is imported and which function called."""
    where, _, name = spec.rpartition(":")
    return f"measuring your model: importing {where or spec}, calling {name or '?'}()"


def describe_isolated(spec: str, sample: str, use_cache: bool = True) -> Model:
    """kit.own_model.describe(spec, sample) run in a child (child_main), after one line on stderr: its Model, or
    ModelError in one line where the model is refused (the child's own line) or could not be measured (timeout,
    signal, exit without an answer, over the memory bound, an answer that does not validate)."""
    seconds, gib = bounds()
    print(f"{what_runs(spec)} (in a child process: at most {seconds:g} s and {gib:g} GiB)", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="kit-measure-") as tmp:
        result, log = Path(tmp) / "result.json", Path(tmp) / "log"
        code = _run_child(result, log, [spec, sample, "1" if use_cache else "0"], seconds, gib)
        _relay(log)
        answer = _answer(result)
    if isinstance(answer, dict) and isinstance(answer.get("refused"), str):
        raise ModelError(printable(answer["refused"], 2000).replace("\n", " "))
    if answer is None:
        raise ModelError(f"--model {spec} could not be measured: {_why(code, seconds, gib)}")
    try:
        return _model_of(spec, sample, answer)
    except (ValueError, TypeError) as exc:
        raise ModelError(f"--model {spec} could not be measured: its measurement answered what does not validate "
                         f"({str(exc)[:200]})") from None


# The child's program: the parent's sys.path (a module:function --model imports as it would here), then the one
# measurement the trainers use too (kit.own_model.describe).
CHILD = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); from kit.measure_child import child_main; "
         "child_main(sys.argv[2:], lambda: __import__('kit.own_model').own_model.describe)")


def _run_child(result: Path, log: Path, args: list[str], seconds: float, gib: float) -> int | None:
    """The child, in its own session (its group ended whole), its output to `log`, no stdin: its exit code (negative:
    the signal), or None after `seconds`."""
    code = CHILD
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="2")  # the address space: no thread pool's arenas
    with open(log, "wb") as out:
        argv = [sys.executable, "-c", code, json.dumps(sys.path), str(os.getpid()), str(result), str(gib), *args]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            try:  # the child's group: anything the model's code started goes with it
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
    return rc


def _relay(log: Path) -> None:
    """The kit's own lines of the child (own_model: ...: a layer measured for real) to stderr; the model's prints
    and any traceback stay out of the checker's output."""
    try:
        text = read_regular(log, LOG_BYTES, nofollow=True, ends=True)[0].decode(errors="replace")
    except (FileProblem, OSError):
        return
    for line in text.splitlines():
        if line.startswith("own_model: "):
            print(printable(line, 1000), file=sys.stderr)


def _answer(result: Path) -> object:
    """The child's JSON answer, read bounded; None where there is none or it is not JSON."""
    try:
        return json.loads(read_regular(result, RESULT_BYTES, nofollow=True)[0])
    except (FileProblem, OSError, ValueError, RecursionError):
        return None


def _why(code: int | None, seconds: float, gib: float) -> str:
    if code is None:
        return (f"no answer after {seconds:g} s (a build, sample or layer that hangs?); fix the model's code, or "
                "give it more time with KIT_MEASURE_SECONDS")
    if code == 3:
        return (f"over the memory bound of {gib:g} GiB (a build or sample that allocates for real?); build on the "
                "device you are given (torch.device), or raise the bound with KIT_MEASURE_GIB")
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the measuring process was killed by {name} (in the model's code or torch's); fix the model's code"
    return (f"the measuring process exited with code {code} without an answer (the model's code ended the process: "
            "sys.exit or os._exit?); a build function returns the layers")


def _model_of(spec: str, sample: str, answer: object) -> Model:
    """The Model of a child's answer, every field checked (kit.model.costs_from_json): ValueError on any doubt."""
    if not isinstance(answer, dict) or set(answer) != {"costs", "ends", "kit", "shared"}:
        raise ValueError("not the fields costs, ends, kit, shared")
    kit = answer["kit"]
    if not isinstance(answer["ends"], bool) or not (kit is None or isinstance(kit, dict) and all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e12
            for k, v in kit.items())):
        raise ValueError("ends or kit of the wrong kind")
    costs = costs_from_json(answer["costs"])
    shared = answer["shared"]  # tied weights: [first layer, later layer, the parameter's name], layers in the model
    if not isinstance(shared, list) or len(shared) > 10_000 or not all(
            isinstance(t, list) and len(t) == 3 and all(isinstance(i, int) and not isinstance(i, bool)
                                                        and 0 <= i < len(costs) for i in t[:2])
            and t[0] < t[1] and isinstance(t[2], str) and len(t[2]) < 1000 for t in shared):
        raise ValueError("shared of the wrong kind")
    return Model(spec, sample, costs, answer["ends"], kit, [tuple(t) for t in shared])


def _die_with_parent(parent: int) -> None:
    """The child ends when the checker (pid `parent`) does (SIGTERM, SIGKILL: its own session keeps it from the
    terminal's signals otherwise): Linux's PR_SET_PDEATHSIG (prctl(2)), then a check that the parent did not end
    before it was set."""
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError, ctypes.ArgumentError):  # not Linux: the parent's wall-clock bound still ends it
        return
    if os.getppid() != parent:
        os._exit(1)


def _out_of_memory(text: str) -> bool:
    """Python's MemoryError or torch's CPU allocator's refusal ("DefaultCPUAllocator: can't allocate memory"), as an
    error's text says them: the memory bound reached."""
    return "MemoryError" in text or "can't allocate memory" in text


def child_main(argv: list[str], describe: Callable[[], Callable[..., Model]]) -> None:
    """The child: the memory bound set, no core dump, then `describe()` (kit.own_model.describe, imported under the
    bound) on the model; its answer (or the one line that refuses the model) written to the parent's file. Exit 3:
    over the memory bound."""
    import resource
    parent, result, gib, spec, sample, use_cache = argv
    _die_with_parent(int(parent))
    limit = int(float(gib) * 2 ** 30)
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # an abort in the model's code leaves no core file behind
    try:
        from dataclasses import asdict
        model = describe()(spec, sample, use_cache == "1")
        answer = {"costs": [asdict(c) for c in model.costs], "ends": model.ends, "kit": model.kit,
                  "shared": [list(t) for t in model.shared]}
    except MemoryError:
        os._exit(3)
    except ModelError as exc:
        if _out_of_memory(str(exc)):  # a build or sample over the bound, said by kit.own_model as its failure
            os._exit(3)
        answer = {"refused": str(exc)}
    except SystemExit as exc:
        answer = {"refused": f"--model {spec} could not be measured: the model's code called sys.exit({exc.code!r}); "
                             "a build function returns the layers, it does not end the process"}
    except Exception as exc:  # noqa: BLE001: whatever the model's code raises is one line
        if _out_of_memory(str(exc)):
            os._exit(3)
        answer = {"refused": f"--model {spec} could not be measured: {type(exc).__name__}: "
                             f"{str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"}
    tmp = Path(result + ".tmp")
    tmp.write_text(json.dumps(answer))
    os.replace(tmp, result)
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown: the model's atexit handlers and threads do not get a say
