"""The torch 2.3 lane: the page's documented engine and torchtext, tested rather than assumed.

`make test` runs these (with the matrix's core tests) in the torch 2.3.1 lane's venv
(torch 2.3.1 + torchtext 0.18 + torchdata 0.8, requirements-torch-2.3.1.txt).
"""
from __future__ import annotations

import pytest
import torch

from conftest import skip_or_fail
from launch import TORCH, bench

pytestmark = pytest.mark.legacy


@pytest.fixture(autouse=True)
def legacy_torch():
    if TORCH > (2, 3):
        pytest.skip(f"torch {torch.__version__} has no torch.distributed.pipeline: the torch 2.3.1 lane runs these "
                    "(make test-lane-2.3.1)")
    try:
        import torchtext
        torchtext.disable_torchtext_deprecation_warning()
        import torchtext.data.utils  # noqa: F401
    except (ImportError, OSError) as exc:
        skip_or_fail(f"torchtext does not load here ({exc})", "KIT_REQUIRE_LANES")


# A corpus with what IMDB reviews hold: <br /> tags, quotes, apostrophes, numbers, ellipses, non-ASCII,
# brackets, URLs, emphasis, runs of punctuation and whitespace.
CORPUS = [
    "I loved this movie!!! <br /><br />It's the BEST film of 2006... really; 10/10.",
    'He said "don\'t go" (twice) -- and she went anyway: classic.',
    "Amélie, Björk & Zoë: naïve café scenes; 3.5 stars? Maybe 4!",
    "Terrible.<br />Worst. Movie. Ever. $5 wasted & 2 hours lost :(",
    "The director's cut (1999) isn't the theatrical one... 'nuff said.",
    "Visit http://www.imdb.com/title/tt0111161/ for more -- or don't.",
    "Tabs\tand\nnewlines   and    spaces; semi;colons:colons,commas",
    "ALL CAPS SHOUTING!!! why?!? Because... I can. ¿Qué? ¡Olé! 日本語のレビュー。",
    "A 'quoted' word, a \"double quoted\" one, and O'Brien's hat.",
    "Numbers: 1,000,000 dollars; 3.14159; 1st, 2nd, 3rd; -5 degrees; 50%.",
] * 3 + ["the the the a a an", "zebra apple mango apple zebra", "b a c b a c"]


def test_builtin_tokenizer_agrees_with_torchtext():
    from torchtext.data.utils import get_tokenizer
    import kit.train.data
    torchtext_tok = get_tokenizer("basic_english")
    for text in CORPUS:
        assert kit.train.data.basic_english(text) == torchtext_tok(text), text


@pytest.mark.parametrize("max_tokens", [6, 25, 10_000])
def test_builtin_vocab_and_ids_agree_with_torchtext(max_tokens):
    from torchtext.data.utils import get_tokenizer
    from torchtext.vocab import build_vocab_from_iterator
    import kit.train.data
    tokens = [kit.train.data.basic_english(t) for t in CORPUS]
    theirs = build_vocab_from_iterator(tokens, specials=kit.train.data.SPECIALS, max_tokens=max_tokens)
    theirs.set_default_index(theirs["<unk>"])
    mine = kit.train.data.build_vocab(tokens, max_tokens)
    assert mine == theirs.get_itos()  # same words in the same order: frequency, then A-Z on ties
    ids_mine = kit.train.data.encode(tokens, mine, 48)
    tok = get_tokenizer("basic_english")
    for row, text in enumerate(CORPUS):
        ids = theirs(tok(text))[:48]
        assert ids_mine[row, : len(ids)].tolist() == ids
        assert not ids_mine[row, len(ids):].any()  # padding is <pad> = 0


def test_trainer_uses_torchtext_and_the_documented_pipe(tmp_path):
    [r] = bench(["--synthetic", "400", "--epochs", "1", "--batch-size", "16", "--cache-dir", str(tmp_path)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "engine torch-pipe" in r.stdout  # --engine auto on torch <= 2.3
    assert "(torchtext tokenizer)" in r.stdout


@pytest.mark.core
@pytest.mark.compat("checkpoint moves")
def test_checkpoint_moves_between_engines(tmp_path):
    ckpt = tmp_path / "pipe.pt"
    common = ["--synthetic", "600", "--batch-size", "16", "--cache-dir", str(tmp_path), "--nlayers", "4"]
    saved = bench([*common, "--engine", "torch-pipe", "--epochs", "1", "--save", str(ckpt)], ntasks=2)
    assert all(r.returncode == 0 for r in saved), saved[0].stderr[-2000:]
    keys_torch = set(torch.load(ckpt))
    loaded = bench([*common, "--engine", "fairscale", "--epochs", "2", "--load", str(ckpt),
                    "--save", str(tmp_path / "fairscale.pt")], ntasks=2)
    assert all(r.returncode == 0 for r in loaded), loaded[0].stderr[-2000:]
    assert f"loaded {ckpt}: epoch 1" in loaded[0].stdout and "engine fairscale" in loaded[0].stdout
    assert set(torch.load(tmp_path / "fairscale.pt")) == keys_torch
    back = bench([*common, "--engine", "torch-pipe", "--epochs", "3", "--load", str(tmp_path / "fairscale.pt")])
    assert back[0].returncode == 0 and "epoch   3 |" in back[0].stdout


def test_rpc_is_shut_down_on_errors(tmp_path):
    # the layout check runs after init_rpc: the error must still end every process, promptly
    ckpt = tmp_path / "pipe.pt"
    common = ["--synthetic", "400", "--batch-size", "16", "--cache-dir", str(tmp_path), "--engine", "torch-pipe"]
    assert bench([*common, "--epochs", "1", "--save", str(ckpt)])[0].returncode == 0
    results = bench([*common, "--load", str(ckpt), "--nlayers", "6"], ntasks=2, timeout=90)
    assert [r.returncode for r in results] == [1, 1]
    assert "saved with another layout: nlayers 4 (now 6)" in results[0].stderr
