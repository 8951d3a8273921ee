"""fllama's command line: one module per subcommand; this package only wires options to library calls."""

__version__ = "0.1.0"
