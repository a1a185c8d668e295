"""``hidden-state`` subcommands contributed by the connector package (serve, extract, demo)."""
