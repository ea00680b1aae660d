"""Will it be fast? The rehearsed step's time on named hardware: a model, not a measurement.

The dry run (zerolab.rehearsal) records what a step does (record.py: ops with their FLOPs and
bytes, ops.py; collectives with their groups; waits; streams), and the time model prices the
record on a device and a topology (hardware.py, topology.py), replays it with the strategy's own
overlap (timeline.py) and reports the four parts a profiled step reports, tokens/s per device, MFU
and the bytes and time per collective kind and link (model.py; report.py prints it).
calibrate.py measures this machine for the `cpu` entry; runs.py reads a run directory for
`python -m zerolab compare`. docs/predict.md is the user's page.
"""
