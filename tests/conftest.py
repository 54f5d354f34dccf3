import os
import tempfile

import pytest
import torch

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
# records of verified data files go to a folder of this test session, not the user's cache
os.environ.setdefault("LOOPFORMER_CACHE_DIR", tempfile.mkdtemp(prefix="loopformer-test-cache-"))


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
