"""Cost models: cluster topology, collectives, compute and memory.

Imported as ``autopar.cost_models``."""
