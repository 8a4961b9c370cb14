"""The command line, on top of everything."""
