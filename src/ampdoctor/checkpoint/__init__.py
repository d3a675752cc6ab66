"""Saved checkpoints: what a file is (``sniff``, torch-free), safe loading (``safe_load``: the security policy),
the scan walk (``scan``), and loading weights into a model (``load_weights``). The scan's records, its pure
analysis and its report live with their stages: ``ampdoctor.records.scan``, ``ampdoctor.analysis.scan``,
``ampdoctor.report.scan_report``."""
