"""The input role of a parallel run and what only it uses."""
