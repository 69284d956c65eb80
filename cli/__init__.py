"""The ``flayer`` command: wires the packages together (one module per subcommand)."""
