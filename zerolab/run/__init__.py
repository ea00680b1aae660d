"""What a run does around the training loop: its directory (directory.py) and the lock on it
(lock.py), its record (record.py: metrics, results, checkpoints as one history), what it writes
(metrics.py, results.py), its memory monitor (monitor.py), stop signals (preempt.py) and
deliberate faults with the board that names a rank that stopped (fault.py)."""
