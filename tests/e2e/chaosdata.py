"""Data for the kill/resume tests: the example's synthetic set, logging every index it serves."""

from __future__ import annotations

import os
import time

import hand_written_loop
from torch.utils.data import Dataset


class LoggedDataset(Dataset):
    """Appends each served index to ``log_path`` (one line, one write) and can be slowed down."""

    def __init__(self, inner, log_path: str | None, delay_s: float) -> None:
        self.inner, self.log_path, self.delay_s = inner, log_path, delay_s

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.log_path:
            fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.write(fd, f"{index}\n".encode())
            os.close(fd)
        return self.inner[index]


def make_data(log_path: str | None = None, delay_s: float = 0.0):
    train, val = hand_written_loop.make_data()
    return LoggedDataset(train, log_path, delay_s), val
