"""Rank information and the few decisions every rank must agree on."""

from torchkeel.dist.agree import agree_all, agree_min, any_rank, any_rank_flags, read_finite
from torchkeel.dist.rank import RankInfo

__all__ = ["RankInfo", "agree_all", "agree_min", "any_rank", "any_rank_flags", "read_finite"]
