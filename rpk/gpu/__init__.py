"""Device code: device choice, CUDA streams, process groups, weight sync, regrouping.

Everything here has a CPU path that the tests run; calls that synchronise with a device
say so in their names.
"""
