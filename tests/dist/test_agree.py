"""Every rank takes the same decision: the agreement helpers under torchrun with gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_ranks_agree(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(HERE / "agree_worker.py"), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["world_size"] == 2
        assert r["finite"] == [True, False]  # rank 0's loss was finite, but rank 1's was not
        assert r["any_stop"] is True  # a signal on rank 0 stops both
        assert r["min_size"] == 16  # rank 0 had no limit, rank 1 needed 16
    assert ranks[0]["host"] == [1.5, 2.0] and ranks[1]["host"] == [1.5, "nan"]
