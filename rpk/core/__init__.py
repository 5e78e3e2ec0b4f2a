"""What every stage shares: records, the Engine / Scorer / Trainer Protocols, enums and
the user-error base. Imports nothing of rpk's, so every other package may depend on it."""
