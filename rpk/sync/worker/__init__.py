"""The worker side of rpk's weight path: code that runs inside vLLM's worker processes.

rpk's own vLLM weight-transfer engines (`gloo`, `cpu_ipc`, `gloo_m2n`, one class each
on `base.RpkWeightEngine`), registered by name from `rpk.sync.backends` by rpk's vLLM
plugin, and the methods vLLM grafts onto its worker (`ext.RpkWorkerExtension`). rpk's
main process never imports them, nor does the trainer.
"""
