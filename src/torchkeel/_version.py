"""The installed version of torchkeel, in a module of its own: reading it imports nothing else."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("torchkeel")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"
