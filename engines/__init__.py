"""Engines: load a bundle's graphs and run them over buffers allocated once at load."""
