"""Names vulture cannot see used: called by name by torch, Hydra, a registry or a string.

`vulture` (configured in pyproject.toml, run by tests/test_house.py) reads this file with the
code; each line below "uses" one name. Add a name here only with the reason it is called."""
from hydra_plugins.zerolab_torchrun import torchrun_launcher
from zerolab.memory import cli as memory_cli
from zerolab.optim import cli as optim_cli
from zerolab.strategies import base, deepspeed, fsdp, torch_zero
from zerolab.strategies.zero import stage3, stages

_ = None
_.forward  # nn.Module.__call__ calls forward
_.launch  # Hydra's Launcher interface: Hydra calls launch(job_overrides, initial_job_idx)
_.hydra_context, _.task_function  # Launcher.setup(*, hydra_context, task_function, config): Hydra passes them
_._return_value  # hydra.core.utils.JobReturn's field, read by Hydra's return_value property
_.frame  # signal.signal handlers take (signum, frame)
torchrun_launcher.TorchrunLauncher  # conf/launcher and hydra.launcher._target_ name it
optim_cli.lr_main, memory_cli.optim_state_main  # zerolab.__main__.COMMANDS names them as "module:function"
# zerolab.strategies.REGISTRY names every strategy class as "module:Class"
deepspeed.DeepSpeedStrategy, fsdp.FSDPStrategy, torch_zero.TorchZeroStrategy
stages.Zero1Strategy, stages.Zero2Strategy, stage3.Zero3Strategy
base.Strategy.zerolab_sharder  # read by names_where(zerolab_sharder=True) in bench/zero.py
# tokenizers.Tokenizer properties set in zerolab/data/prepare.py, read by the library
_.pre_tokenizer, _.decoder, _.post_processor
_.use_cache  # a transformers config attribute set in zerolab/models/sources.py, read by the model's forward
# DeepSpeed's own fields, set by zerolab/strategies/deepspeed_checkpoint.py and read inside DeepSpeed
_._hp_optimizer_states_linked  # its ZeRO-1/2 links optimizer-state fragments again when this is False
_.global_steps, _.global_samples  # the engine's step counts (its schedulers and logs), set on resume
