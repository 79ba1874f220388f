"""An example hpcfl plugin: ``example_slr`` (algorithm), ``example_linear`` (model) and
``example_blobs`` (dataset), declared as entry points in this distribution's pyproject.toml."""
