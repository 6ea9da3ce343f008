"""Adapters that audit a training framework's own DFlash code as the candidate
(``--candidate framework:NAME[==VERSION]``): glue that drives the framework's real code and
records what it computes; what the adapter invents is marked as the adapter's.
"""
