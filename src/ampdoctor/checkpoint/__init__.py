"""Saved checkpoints: what a file is (``sniff``, torch-free), safe loading (``safe_load``: the security policy),
the scan walk (``scan``), its records and pure analysis (``scan_records``, ``scan_analysis``), and loading
weights into a model (``load_weights``)."""
