"""One module per `autotune` command: add_arguments(parser) and run(args) -> exit code."""
