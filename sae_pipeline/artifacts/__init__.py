"""What training leaves behind and other programs read: checkpoints, exported SAEs, codes files.

- :mod:`.export`: the native export (``sae.safetensors`` + ``config.json``).
- :mod:`.saelens`: SAELens 6's format, both ways.
- :mod:`.codes`: the HDF5 codes file ``predict`` writes.
"""
