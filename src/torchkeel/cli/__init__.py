"""The ``keel`` command line: one module per subcommand; each parses arguments and calls the library."""
