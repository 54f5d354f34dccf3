import os
import tempfile

import pytest
import torch

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
# records of verified data files go to a folder of this test session, not the user's cache
os.environ.setdefault("LOOPFORMER_CACHE_DIR", tempfile.mkdtemp(prefix="loopformer-test-cache-"))

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
