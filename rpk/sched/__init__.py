"""Scheduling as plain synchronous code over explicit state: round policies and their
registry (`policy`), one round's bookkeeping (`round`), the data order (`cursor`).
No awaits, no devices: the async drivers in `rpk.loop` do the I/O."""
