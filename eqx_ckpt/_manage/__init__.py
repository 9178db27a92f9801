"""The manager: steps, retention, preemption, `load_or_initialise`."""
