"""The failure bundle's format marker, torch-free so that the CLI can tell a bundle before importing torch."""

BUNDLE_FORMAT = "ampdoctor-bundle"
