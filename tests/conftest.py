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
