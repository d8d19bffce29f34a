"""Rank information and the few decisions every rank must agree on."""

from torchkeel.distributed.agree import agree_all, agree_min, any_rank, any_rank_flags, read_finite
from torchkeel.distributed.rank import RankInfo

__all__ = ["RankInfo", "agree_all", "agree_min", "any_rank", "any_rank_flags", "read_finite"]
