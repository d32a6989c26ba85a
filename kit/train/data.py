"""The data: IMDB from a folder or its tarball (bounded reads), the synthetic corpus, the tokenizer and vocabulary,
the tokenised cache shared by the tasks, the DataLoaders and their workers (which ignore the job's stop signals).
Owns: CACHE_FORMAT and the corpus limits. Imports: kit.findings, kit.train.checkpoint, kit.train.errors,
kit.train.launch, kit.train.signals.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import itertools
import os
import random
import re
import signal
import tarfile
import threading
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import Callable

import torch

from kit.findings import first_line
from kit.train.checkpoint import NotAFile, atomic_torch_save, load_refusal, load_weights_only, open_regular, \
    write_failure
from kit.train.errors import RunError, log
from kit.train.launch import Tasks
from kit.train.signals import STOP_SIGNALS


CACHE_FORMAT = 2  # bump when the tokenised cache layout changes


# data: IMDB from a local folder or tarball (compute nodes have no internet), else a learnable synthetic corpus
_PATTERNS = [(re.compile(p), r) for p, r in [
    (r"\'", " '  "), (r"\"", ""), (r"\.", " . "), (r"<br \/>", " "), (r",", " , "), (r"\(", " ( "), (r"\)", " ) "),
    (r"\!", " ! "), (r"\?", " ? "), (r"\;", " "), (r"\:", " "), (r"\s+", " ")]]

SPECIALS = ["<pad>", "<unk>"]


def basic_english(line: str) -> list[str]:
    """torchtext's basic_english tokenizer, for torch versions where torchtext can't load (it agrees token for
    token; a legacy-lane test checks it)."""
    line = line.lower()
    for pattern, repl in _PATTERNS:
        line = pattern.sub(repl, line)
    return line.split()


def build_vocab(token_lists: list[list[str]], max_tokens: int) -> list[str]:
    """build_vocab_from_iterator(specials=["<pad>", "<unk>"], max_tokens=...): by frequency, ties A-Z."""
    counter = Counter()
    for tokens in token_lists:
        counter.update(tokens)
    ranked = sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))[: max_tokens - len(SPECIALS)]
    return SPECIALS + [w for w, _ in ranked if w not in SPECIALS]


def get_tokenizer() -> tuple[str, object]:
    """torchtext's basic_english where torchtext loads (the torch 2.3 lane), else the equivalent above."""
    try:
        import torchtext
        torchtext.disable_torchtext_deprecation_warning()  # we know: 0.18 is its last release
        from torchtext.data.utils import get_tokenizer as torchtext_tokenizer
        return "torchtext", torchtext_tokenizer("basic_english")
    except (ImportError, OSError, RuntimeError):  # not installed, or its C++ library doesn't load on torch >= 2.4
        return "builtin", basic_english


def make_vocab(tokenizer: str, token_lists: list[list[str]], max_tokens: int) -> list[str]:
    if tokenizer == "torchtext":
        from torchtext.vocab import build_vocab_from_iterator
        return build_vocab_from_iterator(token_lists, specials=SPECIALS, max_tokens=max_tokens).get_itos()
    return build_vocab(token_lists, max_tokens)


def encode(token_lists: list[list[str]], itos: list[str], seq_len: int) -> torch.Tensor:
    stoi = {w: i for i, w in enumerate(itos)}
    out = torch.zeros(len(token_lists), seq_len, dtype=torch.int32)  # 0 = <pad>
    for row, tokens in enumerate(token_lists):
        ids = [stoi.get(w, 1) for w in tokens[:seq_len]]
        if ids:
            out[row, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return out


def find_imdb(data_dir: str) -> Path:
    """The aclImdb/ folder or aclImdb_v1.tar.gz that data_dir is or holds."""
    root = Path(data_dir).expanduser()
    for cand in (root, root / "aclImdb", root / "IMDB" / "aclImdb"):
        if (cand / "train").is_dir() and (cand / "test").is_dir():
            return cand
    for cand in (root, root / "aclImdb_v1.tar.gz", root / "IMDB" / "aclImdb_v1.tar.gz"):
        if cand.is_file() and cand.name.endswith((".tar.gz", ".tgz", ".tar")):
            return cand
    if not root.exists():
        raise RunError(f"--data-dir {data_dir} does not exist; give the folder holding aclImdb/ or "
                       "aclImdb_v1.tar.gz, or leave --data-dir out to use the synthetic corpus")
    raise RunError(f"--data-dir {data_dir} holds neither aclImdb/ (with train/ and test/) nor aclImdb_v1.tar.gz; "
                   "download it once on a login node (https://ai.stanford.edu/~amaas/data/sentiment/)")


# A review is read whole into memory and tokenised: bound what one file, and all of them, may bring in (a 127 kB
# tarball holding one 100 MB review peaked at 2.6 GB). IMDB's reviews are a few kB each, about 65 MB for the 50,000 of
# train/ and test/ together; tokenising 78 MB of text peaked at 1.1 GB here, so the bound on all is 256 MiB.
REVIEW_BYTES = 1 << 20

CORPUS_BYTES = 256 << 20

TAR_ENTRIES = 1_000_000  # IMDB's tarball has about 100,000 (unsup/ included); each header read takes time and memory


def read_imdb(source: Path) -> dict[str, tuple[list[str], list[int]]]:
    """{'train': (texts, labels), 'test': (...)} with label 1 = pos, in a fixed (sorted) order."""
    found: dict[str, list[tuple[str, int, str]]] = {"train": [], "test": []}
    total = [0]

    def take(split: str, name: str, label: int, size: int, read: Callable[[int], bytes]) -> None:
        if size > REVIEW_BYTES:
            raise RunError(f"review {name} in {source} is {size} bytes, more than {REVIEW_BYTES >> 20} MiB: not an "
                           "IMDB review (they are a few kB); remove it, or download aclImdb_v1.tar.gz again")
        total[0] += size
        if total[0] > CORPUS_BYTES:
            raise RunError(f"the reviews of {source} hold more than {CORPUS_BYTES >> 20} MiB of text (at {name}): not "
                           "the IMDB corpus (about 65 MB); check --data-dir")
        found[split].append((name, label, read(REVIEW_BYTES).decode("utf-8", errors="replace")))

    if source.is_dir():
        read_imdb_folder(source, take)
    else:
        read_imdb_tarball(source, take)
    for split, items in found.items():
        if not items:
            raise RunError(f"{source} has no {split}/pos or {split}/neg reviews: it is not a complete aclImdb; "
                           "download aclImdb_v1.tar.gz again")
        items.sort(key=lambda t: (t[1], t[0]))
    return {s: ([t for _, _, t in items], [y for _, y, _ in items]) for s, items in found.items()}


def read_imdb_folder(source: Path, take: Callable) -> None:
    """Every review file of an aclImdb folder, each opened only if it is a regular file (a FIFO among the reviews
    would block the read forever, before --timeout is armed)."""
    for split in ("train", "test"):
        for label in ("neg", "pos"):
            folder = source / split / label
            if not folder.is_dir():
                raise RunError(f"{folder} is missing: {source} is not a complete aclImdb folder")
            for f in sorted(folder.glob("*.txt")):
                try:
                    with open_regular(f) as review:
                        take(split, f.name, int(label == "pos"), os.fstat(review.fileno()).st_size, review.read)
                except OSError as exc:
                    raise RunError(f"cannot read review {f}: {exc.strerror}; "
                                   + ("remove it" if isinstance(exc, NotAFile) else
                                      "fix its permissions or re-extract aclImdb")) from None


def read_imdb_tarball(source: Path, take: Callable) -> None:
    """Every review of aclImdb_v1.tar.gz, read in place, never extracted (a member's path cannot reach outside);
    only regular members, each read at most to the bound."""
    pattern = re.compile(r"(?:^|/)(train|test)/(pos|neg)/[^/]+\.txt$")
    mode = "r:gz" if source.name.endswith((".gz", ".tgz")) else "r:" if source.name.endswith(".tar") else "r:*"
    try:
        with tarfile.open(source, mode) as tar:
            for count in itertools.count(1):
                member = tar.next()
                if member is None:
                    break
                tar.members.clear()  # tarfile keeps every header read (TarFile.next): 0.5 kB each, 150 MB for 300k
                if count > TAR_ENTRIES:
                    raise RunError(f"{source} holds more than {TAR_ENTRIES} entries: not the IMDB tarball (about "
                                   "100,000); download aclImdb_v1.tar.gz again")
                m = pattern.search(member.name)
                if m and member.isfile():
                    take(m.group(1), member.name, int(m.group(2) == "pos"), member.size,
                         tar.extractfile(member).read)
            # tarfile ends its loop quietly at a garbled header past the first member (tarfile.TarFile.next),
            # so a damaged gzip can look like a short archive: reading the stream to its end makes gzip check
            # its CRC and length (gzip._GzipReader raises BadGzipFile, an OSError).
            while tar.fileobj.read(1 << 20):
                pass
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:  # zlib.error: a damaged deflate stream
        why = " ".join(first_line(exc).split())[:160]
        raise RunError(f"cannot read {source}: {why}; it is damaged or not the IMDB tarball: download "
                       "aclImdb_v1.tar.gz again") from None


def synthetic_imdb(n: int, seed: int) -> dict[str, tuple[list[str], list[int]]]:
    """IMDB-like reviews whose label is learnable: filler words plus, now and then, words of the review's
    sentiment (and a little of the other, so it is not trivial)."""
    rng = random.Random(seed)
    filler = [f"w{i}" for i in range(1500)] + ["the", "a", "movie", "film", "plot", "actor", "scene", "and"]
    good = ["great", "wonderful", "superb", "loved", "brilliant", "moving", "best", "fun"]
    bad = ["awful", "boring", "worst", "waste", "terrible", "dull", "hated", "poor"]

    def review(label: int) -> str:
        mine, other = (good, bad) if label else (bad, good)
        words = []
        for _ in range(rng.randint(40, 120)):
            r = rng.random()
            words.append(rng.choice(mine) if r < 0.10 else rng.choice(other) if r < 0.12 else rng.choice(filler))
        return " ".join(words).capitalize() + "."

    ntest = max(n // 4, 64)
    out = {}
    for split, count in (("train", n), ("test", ntest)):
        labels = [i % 2 for i in range(count)]
        out[split] = ([review(y) for y in labels], labels)
    return out


def cache_key(cfg: argparse.Namespace, source: Path | None) -> str:
    """The tokenised cache's name: the options that shape it and the content of what it was built from: the name,
    size and modification time (ns) of every review file read_imdb reads, or of the tarball. A review rewritten in
    place changes its own time, not its folder's (the folder's alone reused a stale cache)."""
    h = hashlib.sha256(f"{CACHE_FORMAT}|{cfg.vocab_size}|{cfg.seq_len}|{cfg.synthetic}|{cfg.seed}".encode())
    if source is None:
        return h.hexdigest()[:16]
    h.update(f"{source.resolve()}\n".encode())
    if not source.is_dir():
        st = source.stat()
        h.update(f"{st.st_size}|{st.st_mtime_ns}".encode())
        return h.hexdigest()[:16]
    for split in ("train", "test"):
        for label in ("neg", "pos"):
            folder = source / split / label
            try:
                with os.scandir(folder) as entries:
                    files = sorted((e.name, e.stat()) for e in entries if e.name.endswith(".txt"))
            except OSError:  # missing or unreadable: read_imdb says so
                files = []
            h.update(f"{split}/{label}:{len(files)}\n".encode())
            for name, st in files:
                h.update(f"{name}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def data_source(cfg: argparse.Namespace) -> Path | None:
    """The IMDB source to read, or None for the synthetic corpus; a bad --data-dir fails here, before any
    process group exists."""
    if cfg.synthetic:
        return None
    if cfg.data_dir:
        return find_imdb(cfg.data_dir)
    dsdir = os.environ.get("DSDIR")
    if dsdir and Path(dsdir, "IMDB").exists():
        return find_imdb(os.path.join(dsdir, "IMDB"))
    cfg.synthetic = 4000
    log(f"notice: no IMDB data (--data-dir not given{', and no $DSDIR/IMDB' if dsdir else ''}): training on "
        f"{cfg.synthetic} synthetic reviews whose labels are learnable. Nothing is downloaded.")
    return None


def build_corpus(cfg: argparse.Namespace, source: Path | None, cache: Path) -> dict:
    """Read and tokenise the corpus, then cache it (a cache that cannot be written costs a notice, not the run)."""
    t0 = time.time()
    raw = read_imdb(source) if source is not None else synthetic_imdb(cfg.synthetic, cfg.seed)
    tokenizer, tokenize = get_tokenizer()
    train_tokens = [tokenize(t) for t in raw["train"][0]]
    itos = make_vocab(tokenizer, train_tokens, cfg.vocab_size)  # from the training split only
    data = {"format": CACHE_FORMAT, "tokenizer": tokenizer, "itos": itos,
            "train_x": encode(train_tokens, itos, cfg.seq_len),
            "train_y": torch.tensor(raw["train"][1], dtype=torch.int64),
            "test_x": encode([tokenize(t) for t in raw["test"][0]], itos, cfg.seq_len),
            "test_y": torch.tensor(raw["test"][1], dtype=torch.int64)}
    try:
        atomic_torch_save(data, cache)
        log(f"data: tokenised {len(raw['train'][0])}+{len(raw['test'][0])} reviews ({tokenizer} tokenizer) "
            f"in {time.time() - t0:.1f}s, cached in {cache}")
    except (OSError, RuntimeError) as exc:  # torch.save wraps a failed write's OSError in a RuntimeError
        log(f"notice: cannot write the cache {cache} ({write_failure(exc)}); every run will tokenise again")
    return data


def read_cache(cache: Path, cfg: argparse.Namespace) -> dict | None:
    """The cached tensors of this corpus, or None (absent, unreadable or another corpus's: rebuilt then)."""
    try:
        data = load_weights_only(cache)
    except FileNotFoundError:
        return None
    except Exception as exc:  # truncated, corrupt, or not a plain file of tensors: rebuild rather than crash
        log(f"notice: the cache {cache} is unreadable ({load_refusal(exc)}); rebuilding it")
        return None
    if corpus_fits(data, cfg):
        return data
    log(f"notice: the cache {cache} does not hold this corpus's tensors; rebuilding it")
    return None


def load_corpus(cfg: argparse.Namespace, source: Path | None, tasks: Tasks) -> dict:
    """Tokenised tensors, built once by rank 0 and cached; the other ranks wait, then load the cache (or build their
    own where they cannot see it). What each task found is gathered (Tasks.agree): one that cannot read the data
    stops all."""
    cache_dir = Path(cfg.cache_dir or os.environ.get("SCRATCH") or
                     (source.parent if source is not None and os.access(source.parent, os.W_OK) else ".cache"))
    name, cache, key = "synthetic" if source is None else "imdb", None, None  # rank 0 computes the key; others take it
    data, problem = None, None
    if tasks.launch.rank == 0:
        try:
            key = cache_key(cfg, source)
            cache = cache_dir / f"{name}-{key}.pt"
            data = read_cache(cache, cfg) or build_corpus(cfg, source, cache)
        except RunError as exc:
            problem = str(exc)
    key = tasks.agree(problem, key)[0]  # rank 0's verdict on the data, before the others read what it cached
    cache = cache_dir / f"{name}-{key}.pt"
    # agree() above is the barrier, on gloo (the tasks' host group), never nccl's: nccl's barrier() picks global
    # rank % GPUs per node, not the current device, and would put task 1 on task 0's GPU (docs/gpu.md, the rule
    # per release)
    problem = None
    try:
        if data is None:
            data = read_cache(cache, cfg) or build_corpus(cfg, source, cache)  # the cache folder may not be shared between nodes: build here then
        check_classes(data, source, cfg)
    except RunError as exc:
        problem = str(exc)
    tasks.agree(problem)
    return data


def corpus_fits(data: object, cfg: argparse.Namespace) -> bool:
    """A cache holds what build() writes for these options: token ids below --vocab-size, --seq-len columns,
    labels 0 or 1, one per review."""
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT or not isinstance(data.get("itos"), list):
        return False
    for split in ("train", "test"):
        x, y = data.get(f"{split}_x"), data.get(f"{split}_y")
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dim() == 2 and y.dim() == 1
                and x.dtype == torch.int32 and y.dtype == torch.int64 and x.size(1) == cfg.seq_len
                and len(x) == len(y) and len(y) > 0):
            return False
        if y.min() < 0 or y.max() > 1 or x.min() < 0 or x.max() >= cfg.vocab_size:
            return False
    return True


def check_classes(data: dict, source: Path | None, cfg: argparse.Namespace) -> None:
    """Both classes in each split: with one alone, training reaches "test acc 1.000" and it means nothing."""
    where = str(source) if source is not None else f"--synthetic {cfg.synthetic}"
    for split in ("train", "test"):
        neg, pos = torch.bincount(data[f"{split}_y"], minlength=2).tolist()[:2]
        if min(neg, pos) == 0:
            have, missing = ("positive", "neg") if pos else ("negative", "pos")
            raise RunError(f"{where}: all {neg + pos} {split} reviews are {have}"
                           + (f" ({split}/{missing} holds none)" if source is not None else "")
                           + ": a classifier needs both classes, and its accuracy would mean nothing; "
                           + (f"add the {split}/{missing} reviews, or check --data-dir" if source is not None
                              else "raise --synthetic"))


class BatchTensors(torch.utils.data.Dataset):
    """Indexed by a whole batch of indices: one gather per batch instead of B small ones and a collate."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(idx)
        x = self.x[idx]  # token ids as int64; a --model's synthetic floats as they are (kit.train.own)
        return (x if x.is_floating_point() else x.long()), self.y[idx]


def make_loader(x: torch.Tensor, y: torch.Tensor, batch: int, replicas: int, rank: int, drop_last: bool,
                seed: int, workers: int, pin: bool, shuffle: bool = True) -> torch.utils.data.DataLoader:
    """Replica `rank` of `replicas` gets its own share (the tasks of one pipeline share one)."""
    sampler = torch.utils.data.DistributedSampler(BatchTensors(x, y), num_replicas=replicas, rank=rank,
                                                  shuffle=shuffle, seed=seed, drop_last=drop_last)
    batches = torch.utils.data.BatchSampler(sampler, batch, drop_last=drop_last)
    return Loader(BatchTensors(x, y), sampler=batches, batch_size=None, num_workers=workers, pin_memory=pin,
                  persistent_workers=workers > 0, worker_init_fn=functools.partial(worker_keeps_on, os.getpid()))


class Loader(torch.utils.data.DataLoader):
    """A DataLoader whose workers live through the job's stop signals, which their trainer acts on (StopRequest).
    Slurm signals every process of a step (scancel, preemption, the time limit), a terminal's Ctrl-C its whole
    foreground group. torch's worker loop (torch/utils/data/_utils/worker.py, _worker_loop) installs DataLoader.cpp's
    handler_SIGTERM: exit 0 if the sender is the worker's parent, else die by SIGTERM, and the trainer fails on
    "DataLoader worker (pid ...) is killed by signal: Terminated"; SIGINT's KeyboardInterrupt ends the loop
    quietly, the trainer waiting for a worker that is gone. The workers are forked in __iter__ (the first one, they
    persist): with the stop signals blocked, so that none reaches a worker before worker_keeps_on has run, and no
    thread of a worker (torch starts some before it) ever takes SIGTERM with torch's handler."""

    def __iter__(self) -> object:
        if not self.num_workers:
            return super().__iter__()
        before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # a signal meanwhile is held, not lost
        try:
            return super().__iter__()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)


def worker_keeps_on(trainer: int, worker_id: int) -> None:
    """worker_init_fn (Loader): SIGINT and SIGUSR1 ignored; SIGTERM, blocked in every thread, taken by one thread
    that keeps torch's rule for the trainer's own SIGTERM alone: DataLoader's _shutdown_workers and
    multiprocessing's exit handler end a worker with terminate() and then wait for it (ignored, the trainer's exit
    would hang). A worker also ends within 5 s when its trainer dies (the loop's ManagerWatchdog)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    if hasattr(signal, "sigwaitinfo"):
        threading.Thread(target=end_on_sigterm_from, args=(trainer,), name="sigterm", daemon=True).start()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGUSR1})
    else:  # macOS has no sigwaitinfo: SIGTERM as torch's handler takes it (a laptop has no Slurm to send it)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def end_on_sigterm_from(trainer: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == trainer:
            os._exit(0)  # as torch's handler_SIGTERM does for its parent's
