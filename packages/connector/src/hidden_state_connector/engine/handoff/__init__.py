"""Finish-time save orders from the scheduler half to the writing worker, between steps.

A request that finishes after the step's metadata was built is handed over at once,
not a step later: to a worker in the same process (``same_process``), or over an
authenticated local socket (``socket_channel``). Nothing is imported here.
"""
