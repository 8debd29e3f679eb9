"""A worker's life, the same for every engine (see worker.py)."""
