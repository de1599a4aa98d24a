"""The ``fedllm`` command and its subcommands: parse arguments, call the library, map errors to exit codes."""
