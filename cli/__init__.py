"""gptkit's command line: a thin typer + rich front end over the `gptkit` library."""
