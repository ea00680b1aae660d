"""zerolab: a data-parallel training harness that makes ZeRO sharding visible and comparable."""
__version__ = "0.1.0"
