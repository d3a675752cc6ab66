"""The ``ampdoctor`` command line: ``main`` (parser and exit codes), ``common`` (options, output), one module per
subcommand (``demo``, ``scan``, ``diagnose``)."""
