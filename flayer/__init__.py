"""The learning: models, data, partitions, FLAYER's mechanisms, strategies and in-process simulation.

Pure torch + numpy; imports nothing from the other top-level packages.
"""

__version__ = "0.1.0"
