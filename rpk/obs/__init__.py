"""What a run shows and keeps: step records and their files (`metrics`), plots
(`plot`, also `python -m rpk.obs.plot`), the live display and summary (`progress`)."""
