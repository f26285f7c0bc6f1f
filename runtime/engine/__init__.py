"""Request state, KV block pool and scheduler: pure Python, no torch, clock passed in.

A simulator can drive this package with a virtual clock and a cost model in place of
the model runner.
"""
