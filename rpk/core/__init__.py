"""What every stage shares: records and outcomes, the Engine / Scorer / Trainer Protocols
and a fleet's capabilities, enums, the names config checks, and the user-error base.
Imports nothing of rpk's, so every other package may depend on it."""
