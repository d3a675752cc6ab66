"""Saved checkpoints: what a file is (``sniff``, torch-free), which files a scan reads and which it could not
(``listing``), safe loading (``safe_load``: the security policy, with ``global_names``, what a global can do, and
``allow_list``, what ``--unsafe-load`` admits), the scan walk (``scan``), and loading weights into a model
(``load_weights``). The scan's records, its pure analysis and its report live with their stages:
``ampdoctor.records.scan``, ``ampdoctor.analysis.scan``, ``ampdoctor.report.scan_report``."""
