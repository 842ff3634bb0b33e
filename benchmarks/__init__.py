"""Side-by-side measurements of monarch_kernel against raw pyzmq and its peers.

Run ``python -m benchmarks --json out.json``. Every figure of ours is also
given as a ratio to the raw pyzmq baseline measured in the same run.
"""
