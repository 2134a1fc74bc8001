"""The testing wing: fault injection, kept out of the request path.

    faults.py      the fault models (nan/inf/zero/error/stall per step; a gain on a layer's channel;
                   token faults for a remote stream) and FaultySession, a wrapper around a real session
    seam.py        the one seam between a driver and faults.py: for a request without faults every
                   call returns nothing to install at once, and faults.py is never imported
    gguf_patch.py  patched GGUF copies (`qladder faults patch-gguf`): persistent finite corruption

Faults reach a request only where the operator allowed them (`qladder serve --allow-faults`, the
serving engine's `allow_faults`) or from an in-process caller (the validation harness).
tests/test_fault_seam.py checks that no runtime module outside this package imports faults.py.
This package's __init__ imports nothing: loading the seam does not load the faults.
"""
