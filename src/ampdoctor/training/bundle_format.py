"""The failure bundle's format marker, torch-free so that the CLI can tell a bundle before importing torch."""

BUNDLE_FORMAT = "ampdoctor-bundle"
# Where ``ampdoctor.watch`` writes failure bundles unless given ``bundle_dir`` (a folder in the current directory,
# which the README and the project's .gitignore name).
DEFAULT_BUNDLE_DIR = "ampdoctor-bundles"
