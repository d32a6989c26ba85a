"""Checkpoints and resume: --save's pair (the page's model file and its companion), written atomically under a
lock, the output files checked before training, and --resume's reading with a rule for every argument (its Arg's
`resume`, kit.arguments.RESUME_RULES). Owns: RESUME_FORMAT, ARCHITECTURE, the checkpoint's format (docs/faults.md),
Saves (a run's saves). Imports: kit.arguments, kit.findings, kit.plan, kit.train.errors, kit.train.launch,
kit.train.signals, kit.train.trainer.
"""
from __future__ import annotations
from typing import TYPE_CHECKING

import argparse
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import io
import json
import os
import pickle
import random
import re
import secrets
import socket
import stat
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import idr_torch
import kit.arguments
import kit.plan
from kit.findings import first_line
from kit.train.errors import RunError, log
from kit.train.launch import Tasks
from kit.train.signals import interrupts_held

if TYPE_CHECKING:  # a type only
    from kit.train.trainer import Trainer


RESUME_FORMAT = "bench_ddp_transformer/resume/1"  # the companion file of --save (what resuming needs)


# The architecture of the saved model (the companion records it; a checkpoint of another one is refused in one
# line). post-ln/2: the page's blocks (nn.TransformerEncoderLayer: LayerNorm after each residual add), the embedding
# no longer scaled by sqrt(d_model) (post-ln/1 scaled it). What made the GPU defaults collapse to one class on an
# H200 (d_model 1024, AdamW at 1e-3 constant, at every depth) was the rate, not the blocks: lr x d_model about 1.
# Measured on the CPU at d_model 1024, 2 layers, 20 steps (docs/gpu.md): at lr 1e-3 with a 10 % warmup the page's
# blocks went to a running loss of 3.3 and pre-LN blocks with a final LayerNorm to 1.8 (both test acc 0.500); at
# the new default (1e-4, --lr) both stayed at or under 0.74 and learned (0.598 and 0.576 after 20 steps). So the
# page's blocks stay, and with them the memory model's op-by-op tape of that exact layer.
ARCHITECTURE = "post-ln/2"

ARCHITECTURE_CHANGE = "the embedding is no longer scaled by sqrt(d_model)"


def check_outputs(cfg: argparse.Namespace) -> None:
    """Fail before training, not after an hour of it: every file this run writes (--save, its companion and lock,
    --json-out) must be a regular file or nothing yet, in an existing folder where a file can really be written.
    A device node is refused for --save: the atomic rename would replace it (as root, --save /dev/null would
    replace /dev/null). --json-out is appended to, so a character device or a pipe (/dev/null, /dev/stdout) is
    fine there, a block device is not."""
    if cfg.save and cfg.json_out and Path(cfg.save).expanduser().resolve() == Path(cfg.json_out).expanduser().resolve():
        raise RunError(f"--save and --json-out are both {cfg.save}: the checkpoint would replace the results; give "
                       "them two names")
    for option, path in (("--save", cfg.save), ("--json-out", cfg.json_out)):
        if not path:
            continue
        target = Path(path).expanduser()
        for file in ((target, resume_file(target), lock_file(target)) if option == "--save" else (target,)):
            check_output_file(option, path, file)
        folder = target.resolve().parent
        if not folder.is_dir():
            raise RunError(f"{option} {path}: folder {folder} does not exist; create it (mkdir -p {folder}) or "
                           "choose another path")
        probe_folder(option, path, folder)


PROBE_BYTES = 1 << 20  # what the write check writes: an empty file fits on a full disk and proves nothing


def probe_folder(option: str, path: str, folder: Path) -> None:
    """Really write (and remove) a file in `folder`: permissions, ACLs, a read-only mount, a full disk, quota of
    blocks or of inodes. The bytes are written and fsync'ed, since a network file system (NFS, GPFS) may report a
    full quota only when the data reaches the server."""
    probe = None
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=folder)
        with os.fdopen(fd, "wb") as f:
            f.write(bytes(PROBE_BYTES))
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        raise RunError(f"{option} {path}: cannot write in {folder} ({exc.strerror}"
                       + (f": not even {PROBE_BYTES >> 20} MiB fits" if full else "") + "); "
                       + ("free space there (on Jean Zay, idr_quota_user and idr_quota_project show the quotas), or "
                          "choose another path"
                          if full else "choose a path under $WORK or $SCRATCH")) from None
    finally:
        if probe is not None:
            with contextlib.suppress(OSError):
                os.unlink(probe)


def file_kind(mode: int) -> str | None:
    """What a file that is not a regular file or a folder is, in words (None: a regular file or a folder)."""
    return ("a block device" if stat.S_ISBLK(mode) else "a character device" if stat.S_ISCHR(mode) else
            "a pipe (FIFO)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else None)


def check_output_file(option: str, path: str, file: Path) -> None:
    """`file`, if it exists, is one this run may replace (--save) or append to (--json-out)."""
    try:
        mode = file.stat().st_mode  # through a symbolic link: what would be written is what it points to
    except FileNotFoundError:
        return
    except OSError as exc:
        raise RunError(f"{option} {path}: cannot use {file} ({exc.strerror})") from None
    if stat.S_ISDIR(mode):
        raise RunError(f"{option} {path}: {file} is a folder; give a file name, e.g. {option} {file / 'model.pt'}"
                       if file == Path(path).expanduser() else
                       f"{option} {path}: {file} is a folder, where this run writes a file; remove it or choose "
                       "another path")
    kind = file_kind(mode)
    if kind and (option == "--save" or stat.S_ISBLK(mode) or stat.S_ISSOCK(mode)):
        raise RunError(f"{option} {path}: {file} is {kind}, not a regular file: "
                       + ("saving replaces the file by renaming a new one over it, so it would replace the device; "
                          if option == "--save" else "") + "choose a file under $WORK or $SCRATCH")
    if option == "--json-out" and not os.access(file, os.W_OK):
        raise RunError(f"--json-out {path}: {file} is not writable (permission denied); choose another file")


# checkpoints. --save PATH is exactly the page's file, `torch.save(ddp_mp_model.module.state_dict(), PATH)`, so
# the page's `model.load_state_dict(torch.load(PATH))` loads it; what resuming needs (optimizer, epoch, batch, RNG
# states, the layout) goes in PATH.resume.pt beside it, with the SHA-256 of the model file it goes with. Rank 0
# writes both, holding PATH.lock (SaveLock: one writer per PATH).
#
# The two files change as a pair although no rename swaps two files at once: the new companion is first staged,
# whole, as .PATH.resume.pt.next; then the model file is renamed over PATH (the commit point); then the staged
# companion over PATH.resume.pt. A save killed at any point leaves a model file and a companion naming its digest:
# the old companion before the commit, the staged one after it. read_resume() takes whichever matches; the next
# save finishes (or drops) what a killed one left, and removes its temporary files. Each file is written beside its
# target (one file system, so the rename is atomic) and fsync'ed before its rename; the folder is fsync'ed after
# it, so the rename also survives a crash of the node. Files get the user's umask (teams share checkpoints through
# project folders). Every file the kit loads is read with weights_only=True: plain tensors, numbers, strings,
# lists, tuples and dicts (optimizer and GradScaler state_dicts, RNG states are all of those); a pickled object that
# would run code is refused.
def real_paths(cfg: argparse.Namespace) -> None:
    """--save and --load as the files they name, resolved once at start-up through every symbolic link: the
    companion, the staged companion and the lock go beside the data, not beside a link to it (there, --resume
    found no companion and restarted from epoch 0, each save renamed a regular file over the link, and a run
    naming the target directly was not locked out). Every later use, and the checkpoint's record, is this path.
    A path whose last part is no link is kept as given (a linked folder above it holds the pair all the same)."""
    for option in ("save", "load"):
        given = getattr(cfg, option)
        if given and os.path.islink(os.path.expanduser(given)):
            real = os.path.realpath(os.path.expanduser(given))
            what = ("the checkpoint, its companion and its lock are kept" if option == "save" else
                    "the checkpoint and its companion are read")
            log(f"notice: --{option} {given} is a symbolic link to {real}: {what} there")
            setattr(cfg, option, real)


def resume_file(path: str | Path) -> Path:
    return Path(path).expanduser().with_name(Path(path).name + ".resume.pt")


def staged_file(path: str | Path) -> Path:
    """Where a save stages the new companion until its model file is committed."""
    return Path(path).expanduser().with_name(f".{Path(path).name}.resume.pt.next")


def lock_file(path: str | Path) -> Path:
    return Path(path).expanduser().with_name(Path(path).name + ".lock")


def temporary_file(target: Path) -> Path:
    return target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")


def stale_temporaries(target: Path) -> list[Path]:
    """What killed saves of `target` left: its own and its companion's temporary files."""
    own = re.compile(rf"\.{re.escape(target.name)}(\.resume\.pt)?\.[0-9a-f]{{8}}\.tmp")
    return [p for p in target.parent.iterdir() if own.fullmatch(p.name)]


def layout_of(cfg: argparse.Namespace, nb_part: int) -> dict:
    """What a checkpoint must match: the model and how many parts it is cut in (whatever the layout:
    nb_part 2 here and bench_stage.py --pp 2 hold the same parts under the same keys)."""
    own = getattr(cfg, "model_spec", None)  # --model: its spec and its split (kit.train.own.resolve_model sets both)
    return {"architecture": ARCHITECTURE, "nb_part": nb_part,
            **{a.dest: getattr(cfg, a.dest) for a in kit.arguments.ARGS if a.checkpoint},
            "part_sizes": cfg.model_sizes if own else kit.plan.part_sizes(cfg.nlayers, nb_part),
            **({"model": own} if own else {})}


def rng_states(tasks: Tasks) -> list[dict] | None:
    """Every rank's random state (dropout masks differ per replica), gathered on rank 0 for its checkpoint: byte
    tensors and Python's (version, tuple of ints, None), which weights_only loads as they were."""
    mine = {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    if tasks.launch.size == 1:
        return [mine]
    everyone: list | None = [None] * tasks.launch.size if tasks.launch.rank == 0 else None
    dist.gather_object(mine, everyone, dst=0, group=tasks.host_group)
    return everyone


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open_regular(path) as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_file(obj: object, target: Path) -> Path:
    """torch.save into a new temporary file beside `target`, created with the user's umask (mkstemp's 0600 would
    keep a team from sharing it), flushed and fsync'ed: whole on disk before anything renames it."""
    tmp = temporary_file(target)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        cause = os_error_in(exc)  # torch.save wraps a failed write's OSError in a RuntimeError about zip offsets
        if cause is not None and cause.filename is None:
            raise OSError(cause.errno, cause.strerror, str(target)) from exc  # say which file could not be written
        raise
    return tmp


def sync_folder(folder: Path) -> None:
    """fsync a folder, so that a rename in it survives a crash of the node, not only of the process."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot sync a folder (EINVAL): the rename is atomic all the same
        pass
    finally:
        os.close(fd)


def atomic_torch_save(obj: object, path: Path) -> None:
    """Write to a temporary file in the same folder, fsync, then rename: readers see the old file or the new
    one, never half of one, even if this process is killed mid-write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = write_file(obj, path)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sync_folder(path.parent)


@interrupts_held  # a second Ctrl-C waits for the pair to be whole (hold_signal)
def save_checkpoint(path: str, model_state: dict, resume: dict) -> None:
    """The pair, replaced as a pair (see above): both files written whole, the companion staged, the model file
    committed, the companion moved into place. A failure before the commit removes what it wrote and leaves the
    previous pair as it was."""
    target = Path(path).expanduser()
    companion, staged = resume_file(target), staged_file(target)
    settle_pair(target)
    written: list[Path] = []
    try:
        written.append(write_file(model_state, target))
        written.append(write_file(dict(resume, model_sha256=file_digest(written[0])), companion))
        os.replace(written[1], staged)
        written[1] = staged
        sync_folder(target.parent)
        os.replace(written[0], target)  # the commit: from here on the staged companion is the one that matches
        written = []
        sync_folder(target.parent)
        os.replace(staged, companion)
        sync_folder(target.parent)
    except BaseException:
        for file in written:
            file.unlink(missing_ok=True)
        raise


def settle_pair(target: Path) -> None:
    """Before a save, by the lock's holder: finish what a killed save left (its staged companion, when the model
    file it names was committed) or drop it (when it was not), and remove the killed save's temporary files."""
    staged = staged_file(target)
    if staged.exists():
        try:
            state = load_weights_only(staged)
        except Exception:  # written whole before its rename, so only a damaged disk gets here: drop it
            state = None
        if isinstance(state, dict) and target.exists() and state.get("model_sha256") == file_digest(target):
            os.replace(staged, resume_file(target))
        else:
            staged.unlink(missing_ok=True)
        sync_folder(target.parent)
    for tmp in stale_temporaries(target):
        tmp.unlink(missing_ok=True)


@dataclasses.dataclass
class Saves:
    """A run's checkpoints as rank 0 knows them (train() makes one and passes it on): the corpus the run reads (what
    a save records of its data, and a resume checks: corpus_identity; empty for a --model on synthetic batches),
    what the --save file holds, and why the last save failed (None: it did not)."""
    corpus: dict = dataclasses.field(default_factory=dict)
    on_disk: str | None = None
    failed: str | None = None


def save_progress(cfg: argparse.Namespace, trainer: Trainer, tasks: Tasks, saves: Saves, epoch: int, batches: int,
                  n_batches: int, step: int) -> bool:
    """Every rank calls it (the RNG states, and the stage layout's consolidation, are collectives); rank 0
    writes --save and its companion. epoch: the one in progress (from 0), `batches` of its `n_batches` done: all of
    them is the epoch done, fewer (a stop signal, --max-steps) a point inside it that --resume goes on from.
    A save that fails (a full disk, a quota) is one line, the previous pair stays, and training goes on: the
    next save tries again. Returns whether rank 0 saved (True on the other ranks)."""
    if not cfg.save:
        return False
    done = batches == n_batches
    epoch, batch_in_epoch = (epoch + 1, 0) if done else (epoch, batches)
    state = trainer.state()
    rngs = rng_states(tasks)
    if tasks.launch.rank != 0:
        return True
    model_state, optimizer_state = state
    try:
        save_checkpoint(cfg.save, model_state, {
            "format": RESUME_FORMAT, "optimizer": optimizer_state, "epoch": epoch, "batch_in_epoch": batch_in_epoch,
            "samples_in_epoch": batch_in_epoch * cfg.batch_size * trainer.dp_size,
            "step": step, "layout": layout_of(cfg, trainer.nb_part), "engine": trainer.engine, "rng": rngs,
            "data": dict(saves.corpus),
            "args": {k: v for k, v in vars(cfg).items() if isinstance(v, (int, float, str, type(None)))}})
    except (OSError, RuntimeError) as exc:  # torch.save wraps the OSError of a failed write in a RuntimeError
        kept = (f"the previous checkpoint {cfg.save} (with its {resume_file(cfg.save).name}) is kept"
                if Path(cfg.save).expanduser().exists() else f"there is no previous checkpoint in {cfg.save}")
        saves.failed = f"epoch {epoch}, step {step}: {write_failure(exc)}"
        print(f"{tasks.prog}: error: checkpoint not saved (epoch {epoch}, step {step}): {write_failure(exc)}; {kept}; "
              "training goes on and the next save tries again", file=sys.stderr, flush=True)
        return False
    saves.failed, saves.on_disk = None, position_text(epoch, batch_in_epoch, step)
    return True


def position_text(epoch: int, batch_in_epoch: int, step: int) -> str:
    """A checkpoint's position as the resume line says it: 'epoch 1 + 3 batches, step 12'."""
    return f"epoch {epoch}" + (f" + {batch_in_epoch} batches" if batch_in_epoch else "") + f", step {step}"


def check_last_save(cfg: argparse.Namespace, saves: Saves) -> None:
    """At the end of a run (rank 0): if the last save failed, the --save file is older than this run's end, and the
    run says so in one line and exits 1, instead of ending as if its checkpoint were current."""
    if not saves.failed or idr_torch.rank != 0:
        return
    held = (f"{cfg.save} holds {saves.on_disk}" if saves.on_disk else
            f"{cfg.save} holds an earlier run's checkpoint" if Path(cfg.save).exists() else
            f"there is no checkpoint in {cfg.save}")
    raise RunError(f"training ended, but the last checkpoint was not saved ({saves.failed}): {held}, not where "
                   "this run ended; free space there (or give another --save) and run again with --resume to train "
                   "the rest again")


def corpus_identity(data: dict) -> dict:
    """What a checkpoint records of the corpus it trained on: the review counts, and the vocabulary (which word
    each embedding row stands for), as a digest."""
    itos = "\n".join(data["itos"]).encode("utf-8", errors="surrogatepass")
    return {"train": len(data["train_y"]), "test": len(data["test_y"]),
            "vocab_sha256": hashlib.sha256(itos).hexdigest()[:16]}


def os_error_in(exc: BaseException) -> OSError | None:
    """The OSError an exception is, or was raised from or while handling."""
    while exc is not None and not isinstance(exc, OSError):
        exc = exc.__cause__ or exc.__context__
    return exc


def write_failure(exc: BaseException) -> str:
    """Why a write failed, in a few words: the OSError underneath, and its file."""
    cause = os_error_in(exc)
    if cause is None:
        return first_line(exc)[:160]
    return f"{cause.strerror or cause}" + (f" ({cause.filename})" if cause.filename else "")


class NotAFile(OSError):
    """A path the kit reads that is not a regular file: a FIFO (reading one waits for a writer forever, before
    --timeout is armed and while SIGTERM is held), a device, a socket, a folder."""


def open_regular(path: str | Path) -> io.BufferedReader:
    """Open `path` for reading only if it is a regular file (through links). A FIFO or device is never opened: stat
    first; then the open itself is non-blocking (a FIFO swapped in meanwhile does not block it) and what was
    opened is checked again (fstat), so no rename in between gets past."""
    def refusal(st: os.stat_result) -> NotAFile:
        what = "a folder" if stat.S_ISDIR(st.st_mode) else file_kind(st.st_mode)
        return NotAFile(errno.EINVAL, f"{what}, not a regular file", str(path))

    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise refusal(st)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise refusal(st)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def load_weights_only(path: Path) -> object:
    """torch.load as every file of the kit is loaded: tensors and plain values only, nothing that runs code, and
    from a regular file only."""
    with open_regular(path) as f:
        return torch.load(f, map_location="cpu", weights_only=True)


def load_refusal(exc: Exception) -> str:
    """Why torch.load refused a file, in one line."""
    if isinstance(exc, pickle.UnpicklingError):  # what weights_only raises on anything but tensors and plain values
        return ("it holds Python objects besides tensors and plain values, which could run code when loaded: "
                "refused")
    if isinstance(exc, NotAFile):
        return f"it is {exc.strerror}"
    return f"{type(exc).__name__}: {first_line(exc)[:120]}"


def read_model(path: str) -> dict:
    """The --load file: a state_dict, the page's or ours (the page's own torch.load, weights only), finite."""
    try:
        state = load_weights_only(Path(path).expanduser())
    except FileNotFoundError:
        raise RunError(f"--load {path}: no such file") from None
    except NotAFile as exc:
        raise RunError(f"--load {path} is {exc.strerror}: give the file --save wrote (or the page's torch.save "
                       "file)") from None
    except Exception as exc:
        raise RunError(f"--load {path} is not a readable model file ({load_refusal(exc)}); it may be truncated: use "
                       "an earlier one") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise RunError(f"--load {path} is not a state_dict (what torch.save(model.module.state_dict(), path) "
                       "writes)")
    for key, value in state.items():
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise RunError(f"--load {path} holds non-finite values (nan or inf) in {key}: it comes from a run that "
                           "diverged; use an earlier checkpoint")
    return state


# What a companion holds, each of its own type (a hand-made or damaged one is one line, not a KeyError)
RESUME_FIELDS = {"format": str, "epoch": int, "batch_in_epoch": int, "step": int, "layout": dict,
                 "optimizer": (dict, type(None)), "rng": (list, type(None)), "model_sha256": str}


def load_companion(companion: Path, path: str) -> dict:
    """A companion, read weights-only and checked field by field."""
    alone = f"delete it to load {path}'s weights alone, with a fresh optimizer"
    try:
        state = load_weights_only(companion)
    except Exception as exc:
        raise RunError(f"{companion} is unreadable ({load_refusal(exc)}); {alone}") from None
    if not isinstance(state, dict) or state.get("format") != RESUME_FORMAT:
        raise RunError(f"{companion} was not written by this kit's --save; {alone}")
    for key, kind in RESUME_FIELDS.items():
        if not isinstance(state.get(key), kind) or (kind is int and state[key] < 0):
            found = "no" if key not in state else f"a bad ({type(state[key]).__name__})"
            raise RunError(f"{companion} has {found} '{key}' field: it is damaged or was edited; {alone}")
    for key, why in (("samples_in_epoch", samples_problem(state)), ("rng", rng_problem(state["rng"]))):
        if why:
            raise RunError(f"{companion} has a bad '{key}' field ({why}): it is damaged or was edited; {alone}")
    return state


def samples_problem(state: dict) -> str | None:
    """Why a companion's samples_in_epoch (absent before it was recorded) cannot be where its batch count is."""
    samples = state.get("samples_in_epoch")
    if samples is None:
        return None
    if type(samples) is not int or samples < 0:
        return f"{samples!r} is not a count of samples"
    if (samples == 0) != (state["batch_in_epoch"] == 0):
        return f"{samples} samples into an epoch at batch {state['batch_in_epoch']}"
    return None


def rng_problem(rngs: list | None) -> str | None:
    """Why a companion's RNG states would not restore (None: they would), tried on throwaway generators so that the
    check changes no stream: every task checks every rank's entry, so all reach the same verdict before any of
    them restores its own (restore_rng)."""
    for rank, entry in enumerate(rngs or []):
        try:
            torch.Generator().set_state(entry["torch"])
            random.Random().setstate(entry["python"])
            cuda = entry.get("cuda", [])
            if not isinstance(cuda, list):
                raise TypeError(f"cuda is a {type(cuda).__name__}, not a list")
            for gpu_state in cuda[: torch.cuda.device_count() if torch.cuda.is_available() else 0]:
                torch.Generator(device="cuda").set_state(gpu_state)
        except Exception as exc:  # what set_state and setstate raise on a damaged state: TypeError, ValueError...
            return f"rank {rank}: {type(exc).__name__}: {first_line(exc)[:100]}"
    return None


def read_resume(path: str, cfg: argparse.Namespace, nb_part: int, corpus: dict | None = None) -> dict | None:
    """The companion that goes with the model file `path` (the settled one, or the staged one of a save killed after
    its commit), checked against this run's layout and, where given, the corpus it reads (Saves.corpus); None if
    there is none (the page's own file)."""
    target = Path(path).expanduser()
    companion, staged = resume_file(target), staged_file(target)
    if not companion.exists() and not staged.exists():
        return None
    digest = file_digest(target)
    state = load_companion(companion, path) if companion.exists() else None
    if state is None or state["model_sha256"] != digest:
        try:
            next_state = load_companion(staged, path) if staged.exists() else None
        except RunError:
            next_state = None
        if next_state is None or next_state["model_sha256"] != digest:
            raise RunError(f"{path} and {companion} come from different saves (the model file was replaced by "
                           f"something other than this kit's --save?); delete {companion} to start from {path}'s "
                           "weights with a fresh optimizer")
        state = next_state
    mine, theirs = layout_of(cfg, nb_part), state["layout"]
    if theirs.get("architecture") != ARCHITECTURE:  # the same keys and shapes, another function of them
        raise RunError(f"--load {path} holds a model of architecture {theirs.get('architecture', 'post-ln/1')} "
                       f"(this kit's is {ARCHITECTURE}: {ARCHITECTURE_CHANGE}); its weights would load and mean "
                       f"something else: start afresh (another --save path), or go on with the kit that saved it")
    if mine.get("model") != theirs.get("model"):  # another model altogether: its keys and shapes mean nothing here
        raise RunError(f"--load {path} holds " + (f"the model of --model {theirs['model']}" if theirs.get("model") else
                       "the kit's own Transformer") + ", not " + (f"--model {mine['model']}" if mine.get("model") else
                       "the kit's own Transformer") + ": rerun with the model it was saved from, or start afresh "
                       "(another --save path)")
    if mine != theirs:
        diff = ", ".join(f"{k} {theirs.get(k)} (now {v})" for k, v in mine.items() if theirs.get(k) != v)
        raise RunError(f"--load {path} was saved with another layout: {diff}; rerun with the saved values "
                       f"(e.g. --nb-part {theirs.get('nb_part')} --nlayers {theirs.get('nlayers')})")
    check_resumed_settings(path, cfg, state, corpus or {})
    return state


def check_resumed_settings(path: str, cfg: argparse.Namespace, state: dict, corpus: dict) -> None:
    """Each setting this run gives another value than the saved run: refused in one line, or applied and said
    (`corpus`: what this run reads, Saves.corpus; empty: not checked)."""
    saved, data = state.get("args") or {}, state.get("data") or {}
    if "seed" in saved and saved["seed"] != cfg.seed:
        raise RunError(f"--seed {cfg.seed}: {path} was saved by a run with --seed {saved['seed']}, which fixes the "
                       "order of the data that this resume continues (each epoch is shuffled with seed + epoch); "
                       f"rerun with --seed {saved['seed']}, or start a new run (another --save) with --seed "
                       f"{cfg.seed}")
    if data and corpus and data != corpus:
        def text(d: dict) -> str:
            return f"{d.get('train')} training reviews, vocabulary {str(d.get('vocab_sha256'))[:8]}"
        given = (f"--data-dir {saved['data_dir']}" if saved.get("data_dir") else
                 f"--synthetic {saved['synthetic']}" if saved.get("synthetic") else "its data")
        raise RunError(f"--load {path} was trained on another corpus ({text(data)}; this run reads {text(corpus)}): "
                       "its place in the epoch and the words of its embedding rows belong to that one; rerun with "
                       f"{given}, or, to start from its weights alone, copy {path} without its "
                       f"{resume_file(path).name} and --load the copy")
    changed = [f"{kit.arguments.ARG[k].flag} {_shown(getattr(cfg, k))} (saved {_shown(v)})"
               + (" (the GradScaler starts at its initial scale)" if k == "precision" and cfg.precision == "fp16"
                  else "")
               for k, v in saved.items() if k in kit.arguments.ARG and kit.arguments.ARG[k].resume == "applied"
               and hasattr(cfg, k) and getattr(cfg, k) != v]
    if changed:
        log(f"  settings changed since the save, applied from this run's first step: {', '.join(changed)}")


def _shown(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else "on" if value is True else "off" if value is False else \
        str(value)


def resume_point(cfg: argparse.Namespace, trainer: Trainer, tasks: Tasks, saves: Saves
                 ) -> tuple[int, int, int, dict | None]:
    """--load, or --resume's --save file if it exists, into the model on every rank (before DDP wraps it):
    (epoch, batch in that epoch, step, the companion), or a fresh start. A file without a companion (the
    page's own) gives the weights and a fresh optimizer, from epoch 0. Every task reads the files itself (a
    folder one node cannot see, a file truncated on one): their verdicts are gathered (Tasks.agree)."""
    found = bool(cfg.resume and not cfg.load and Path(cfg.save).expanduser().exists())
    load = cfg.load or (cfg.save if found else None)
    problem, state = None, None
    if load:
        try:
            model_state, state = read_model(load), read_resume(load, cfg, trainer.nb_part, saves.corpus)
            trainer.load(model_state, state["optimizer"] if state else None)
        except RunError as exc:
            problem = str(exc)
        except (RuntimeError, ValueError, KeyError, IndexError) as exc:
            problem = (f"--load {load} does not fit this model ({first_line(exc)[:160]}); rerun with the options it "
                       "was saved with" + (f": {state.get('args')}" if state else ""))
    seen = tasks.agree(problem, found)
    if len(set(seen)) > 1:
        raise RunError(f"--resume: {cfg.save} exists for task(s) {[r for r, s in enumerate(seen) if s]} but not for "
                       f"task(s) {[r for r, s in enumerate(seen) if not s]}: every task loads it; keep --save on a "
                       "file system every node sees ($WORK, $SCRATCH)")
    if not load:
        return 0, 0, 0, None
    if state is None:
        log(f"loaded {load}: weights only (no {resume_file(load).name} beside it): fresh optimizer, epoch 0")
        return 0, 0, 0, None
    start_epoch, step = state["epoch"], state["step"]
    log(f"loaded {load}: {position_text(start_epoch, state['batch_in_epoch'], step)}")
    if load == cfg.save:
        saves.on_disk = position_text(start_epoch, state["batch_in_epoch"], step)
    skip = batches_to_skip(state, cfg.batch_size * trainer.dp_size)
    per_epoch = saves.corpus.get("train", 0) // trainer.dp_size // cfg.batch_size  # as make_loaders' drop_last cuts it
    if skip and skip >= per_epoch > 0:  # the save's samples cover every batch this run's epoch holds
        log(f"  epoch {start_epoch + 1}: skipped, its {per_epoch} batches of {cfg.batch_size} x {trainer.dp_size} "
            "replica(s) were all trained before the save")
        start_epoch, skip = start_epoch + 1, 0
    return start_epoch, skip, step, state


def batches_to_skip(state: dict, global_batch: int) -> int:
    """Where a run saved inside an epoch goes on: the first samples_in_epoch of the epoch's order are done.
    DistributedSampler deals the epoch's permutation (seeded by seed + epoch, whatever the replica count) to the
    replicas in turn, so k batches of b on each of d replicas are its first k*b*d samples (torch/utils/data/
    distributed.py): with another batch size or replica count, the same samples are a different batch count."""
    skip, samples = state["batch_in_epoch"], state.get("samples_in_epoch")
    if not skip or samples is None or samples == skip * global_batch:
        return skip
    now = samples // global_batch  # rounded down: at most one global batch is trained twice, none left out
    log(f"  the save was {samples} samples into epoch {state['epoch'] + 1} ({skip} batches of "
        f"{samples // skip} over its replicas); with {global_batch} per step now, this run skips {now} batches")
    return now


def restore_rng(state: dict, rank: int) -> None:
    rngs = state.get("rng") or []
    if len(rngs) > rank:  # same world size: each rank continues its own stream
        torch.set_rng_state(rngs[rank]["torch"])
        random.setstate(rngs[rank]["python"])
        if rngs[rank].get("cuda") and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rngs[rank]["cuda"])


class SaveLock:
    """One writer per --save: rank 0 holds PATH.lock for the whole run, and a second run with the same --save is
    refused at start-up with the holder's job, host and PID (the lock file holds them).

    The lock is a POSIX byte-range lock (fcntl F_SETLK, Python's fcntl.lockf), not flock() and not an O_EXCL lock
    file. It is the kind cluster file systems keep coherent across nodes: on IBM Spectrum Scale (GPFS: Jean Zay's
    $WORK and $SCRATCH) fcntl locks exclude other nodes while flock() is node-local (measured on GPFS clusters:
    tox-dev/filelock#389, ibm-granite/granite.build#322); NFS carries fcntl locks to the server (NLM, NFSv4) and
    emulates flock() with them (flock(2), "NFS details"); Lustre keeps both coherent when mounted with -o flock,
    and fails both (ENOSYS) with -o noflock: then this run says it cannot lock and goes on. The holder's kernel
    (or the cluster's lock manager) releases the lock however the process ends, so a killed job leaves no stale
    lock to guess about (an O_EXCL lock file would, and a PID can only be checked on its own node). Two POSIX
    rules shape the code: the lock is the process's (a fork, as DataLoader workers do, does not inherit it), and
    closing any descriptor of the file releases it, so the file is opened once. A clean exit removes the file."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd

    @classmethod
    def take(cls, save: str) -> SaveLock | None:
        lock = lock_file(save)
        for _ in range(5):
            try:  # O_NOFOLLOW: a link planted as the lock file would have this run truncate what it points to
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
            except OSError as exc:
                raise RunError(f"--save {save}: cannot open its lock file {lock} ("
                               + ("a symbolic link: remove it" if exc.errno == errno.ELOOP else
                                  f"{exc.strerror}; {cls.fix(exc)}") + ")") from None
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EACCES, errno.EAGAIN):
                    raise RunError(f"--save {save} is being written by another run: {cls.holder(lock)}; two runs "
                                   "saving to one file overwrite each other's checkpoints: let that one end (or "
                                   "scancel it), or give this one another --save") from None
                log(f"notice: cannot lock {lock} ({exc.strerror}: a file system mounted without locks, such as "
                    f"Lustre's -o noflock): a second run saving to {save} would not be detected")
                return None
            try:  # the holder removes the file when it ends: a lock on a removed file is no lock, take the new one
                if os.path.samestat(os.fstat(fd), os.stat(lock)):
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        else:
            raise RunError(f"--save {save}: its lock file {lock} keeps being replaced; is another run starting?")
        launch = idr_torch.current()
        me = {"job": launch.job_id, "job_name": launch.job_name,
              "host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        held = cls(lock, fd)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        except OSError as exc:  # a full disk or quota: held, so no other run uses the file; nothing is left behind
            held.release()
            raise RunError(f"--save {save}: cannot write its lock file {lock} ({exc.strerror}); "
                           f"{cls.fix(exc)}") from None
        return held

    @staticmethod
    def fix(exc: OSError) -> str:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return "the disk or the quota is full: free space there, or choose another --save"
        return "if no run is writing this checkpoint, delete the lock file, or choose another --save"

    @staticmethod
    def holder(lock: Path) -> str:
        """Who holds `lock`, as it wrote itself there. Only for a process that does not hold it: closing any
        descriptor of the file releases the process's POSIX locks on it."""
        try:
            who = json.loads(lock.read_text())
            job = (f"job {who['job']}" + (f" ({who['job_name']})" if who.get("job_name") else "") + " on host "
                   if who.get("job") else "a process on host ")
            return f"{job}{who['host']}, PID {who['pid']}, since {who['since']}"
        except (OSError, ValueError, KeyError, TypeError):
            return f"a process that has not written its name in {lock} yet"

    def release(self) -> None:
        """Remove the file while still holding it, then let go: a run that opened it meanwhile finds it removed and
        takes a new one."""
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self.fd)
