"""The parts every family composes: linear layers with their execution methods, norms, rope, attention, MLPs."""
