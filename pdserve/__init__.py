"""pdserve's command line (`pdserve serve`, `launch`, `generate`, the node processes) and its
release: the version every process of a cluster must share."""

__version__ = "0.1.0"
