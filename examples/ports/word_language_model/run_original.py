"""Run pytorch/examples ``word_language_model/main.py`` unchanged, with its flags, and print each
validation loss at full precision (the script prints two decimals): the script passes every
loss it reports through ``math.exp`` (its perplexity), which this records.

    python run_original.py SOURCE_DIR --data DATA --emsize 64 --nhid 64 --epochs 3 --seed 1111
"""

from __future__ import annotations

import json
import math
import os
import runpy
import sys

source, *flags = sys.argv[1:]
losses: list[float] = []
exp = math.exp


def recording_exp(value: float) -> float:
    if sys._getframe(1).f_code.co_filename == sys.argv[0]:  # the script's own calls only
        losses.append(float(value))
    return exp(value)


math.exp = recording_exp
sys.argv = [os.path.join(source, "main.py"), *flags]
sys.path.insert(0, source)
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    math.exp = exp
# With --log-interval above the batches per epoch: each epoch's validation loss, then the test loss.
print(json.dumps({"val_loss": losses[:-1], "test_loss": losses[-1]}))
