"""Training-time watch: the runtime, run logic, bundles, replay and the composition of reports."""
