"""A Hydra launcher that runs every job of a multirun under its own torchrun (see torchrun_launcher.py)."""
