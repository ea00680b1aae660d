"""Run train.py as a CPU with AVX512-FP16 would: DeepSpeed's CPU accelerator answering True to
`is_fp16_supported()`, the one predicate that decides whether DeepSpeed (and zerolab's deepspeed
strategy) trains fp16 on a CPU. torch computes fp16 on any CPU (natively there, converted here),
so on this machine the run takes the branch a Sapphire Rapids CI machine takes by itself
(tests/test_reference_strategies.py). Only this worker's own process is changed: no sitecustomize,
so subprocesses (py-cpuinfo's probe during an op load) see DeepSpeed as it is.

  torchrun ... tests/workers/ds_fp16_cpu.py <train.py overrides>
"""
import runpy
import sys
from pathlib import Path

from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

CPU_Accelerator.is_fp16_supported = lambda self: True

TRAIN = str(Path(__file__).resolve().parents[2] / "train.py")
sys.argv = [TRAIN, *sys.argv[1:]]
sys.path.insert(0, str(Path(TRAIN).parent))
runpy.run_path(TRAIN, run_name="__main__")
