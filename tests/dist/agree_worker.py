"""Run under torchrun (2 ranks, gloo): each rank writes what the agreement helpers returned."""

import json
import sys

import torch
import torch.distributed as dist

from torchkeel.distributed import RankInfo, agree_min, any_rank, read_finite

dist.init_process_group("gloo")
rank = RankInfo.from_env()
values = torch.tensor([1.5, float("nan") if rank.rank == 1 else 2.0])  # only rank 1's loss went NaN
host, finite = read_finite(values)
result = {
    "rank": rank.rank,
    "world_size": rank.world_size,
    "host": [v if v == v else "nan" for v in host],
    "finite": finite,
    "any_stop": any_rank(rank.rank == 0),
    "min_size": agree_min(None if rank.rank == 0 else 16),
}
with open(f"{sys.argv[1]}/rank{rank.rank}.json", "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
