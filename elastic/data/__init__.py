"""Which samples each rank trains on (sampler.py)."""
