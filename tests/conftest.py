import atexit
import os
import shutil
import tempfile

import pytest
import torch

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
# records of verified data files go to a folder of this test session, not the user's cache; the process that made
# it (the session, whose workers inherit the variable) removes it at exit
if "LOOPFORMER_CACHE_DIR" not in os.environ:
    os.environ["LOOPFORMER_CACHE_DIR"] = tempfile.mkdtemp(prefix="loopformer-test-cache-")
    atexit.register(shutil.rmtree, os.environ["LOOPFORMER_CACHE_DIR"], ignore_errors=True)

# a run config that trains in a second (LCS of 3 letters, d = 8, 2 loops, 2 steps): the tests' smallest real run
TINY_YAML = """\
task: {name: lcs, options: {length: 3, alphabet_min: 2, alphabet_max: 3}, n_train: 32, n_test: 8}
model: {d_model: 8, n_heads: 2, loops: 2}
train: {steps: 2, batch_size: 4, log_every: 1, eval_every: 1}
eval: {max_loops: 3}
log: {tensorboard: false, progress: false, dynamics: false}
"""


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


class Killed(Exception):
    """Stands for a kill inside training (never caught by the library)."""


@pytest.fixture
def train_killed_at():
    """train_killed_at(cfg, step): train `cfg` and stop it by an exception right after optimiser step `step` (what
    was checkpointed before survives for --resume)."""
    from loopformer.train.trainer import train

    def run(cfg, step: int) -> None:
        def kill_at(done: int) -> None:
            if done == step:
                raise Killed

        with pytest.raises(Killed):
            train(cfg, on_step=kill_at)

    return run


PLAY_WORDS = "to be or not that is the question whether tis nobler in mind suffer slings arrows".split()


def text_checkpoint(tmp, docs: dict[str, int], *, words=PLAY_WORDS, per_line: int = 6, vocab_size: int = 280,
                    prepare: tuple[str, ...] = (), modulation_std: float = 0.0):
    """A prepared corpus in tmp/data of random lines of `words` (`docs`: a file name and its number of lines; with
    several, tmp/docs holds them as documents) and a tiny TMLT checkpoint on it in the run folder tmp/run (its
    modulations drawn with `modulation_std`, so the loop index matters): (corpus, model)."""
    import numpy as np

    from loopformer.cli import main
    from loopformer.model import LoopedTransformer, ModelConfig
    from loopformer.model.io import save_checkpoint
    from loopformer.text.dataset import TokenCorpus

    rng = np.random.default_rng(0)
    folder = tmp / "docs" if len(docs) > 1 else tmp
    folder.mkdir(exist_ok=True)
    for name, lines in docs.items():
        (folder / name).write_text("".join(" ".join(rng.choice(words, per_line)) + "\n" for _ in range(lines)))
    source = folder if len(docs) > 1 else folder / next(iter(docs))
    assert main(["text", "prepare", str(source), "--out", str(tmp / "data"), "--vocab-size", str(vocab_size),
                 *prepare, "--quiet"]) == 0
    corpus = TokenCorpus(tmp / "data")
    torch.manual_seed(0)
    model = LoopedTransformer(ModelConfig(vocab_size=corpus.vocab_size, max_len=24, d_model=16, n_heads=2, loops=2,
                                          timestep=True, input_injection=True)).eval()
    if modulation_std:
        for blk in model.blocks:
            torch.nn.init.normal_(blk.modulation.weight, 0, modulation_std)
    save_checkpoint(tmp / "run" / "checkpoint", model, task={"name": "text", "data_dir": str(tmp / "data")})
    return corpus, model


def one_line_error(capsys, needle: str) -> None:
    """The command's stderr is one `loopformer: error:` line holding `needle`."""
    err = capsys.readouterr().err
    assert err.startswith("loopformer: error: ") and err.count("\n") == 1 and needle in err, err
