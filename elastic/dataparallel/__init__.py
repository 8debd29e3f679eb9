"""The data-parallel engine: state (state.py), one step (step.py), gradient reduction
(reduce.py), plugged into the runtime by engine.py."""
