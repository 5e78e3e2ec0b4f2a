"""Built-in verifiable tasks: prompts, reference solutions and veRL-style reward functions.

`rpk.tasks.arith` is the default: multi-digit addition whose needed response length grows
with the digit count, which is heavy-tailed across prompts (the long tail rpk exists for).
"""
