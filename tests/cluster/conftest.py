import sys
from pathlib import Path

# The helpers of tests/dist (distrun: the config, the environment, reading checkpoints) serve here too.
sys.path.insert(0, str(Path(__file__).parents[1] / "dist"))
