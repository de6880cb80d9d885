"""Tools built on the early-exit runtime: command line, conversion helpers, assets, cost model, benchmark, demo.

Nothing in the runtime imports this package.
"""
