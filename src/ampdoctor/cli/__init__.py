"""The ``ampdoctor`` command line: ``main`` (parser and exit codes), ``common`` (options, output, warnings, the
guard around the user's code), ``inputs`` (diagnose's arguments checked before torch, the model, the batch),
one module per subcommand (``demo``, ``scan``, ``diagnose``)."""
