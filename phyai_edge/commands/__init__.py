"""One module per `phyai-edge` subcommand (see `phyai_edge.cli`)."""
