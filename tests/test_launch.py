"""Launch paths without Slurm: launch/torchrun.sh, and a two-"node" job whose torchrun agents
rendezvous over loopback (--nnodes=2, one worker each), which must train exactly like a one-node
2-rank job (fp32, same world size and reduction order; model.bias=false as in test_ddp.py)."""
from __future__ import annotations

import json
import subprocess

import pytest

from conftest import ROOT, TORCHRUN, assert_same_weights, base_env, load_weights, read_metrics, run_process, run_train
from ranks import free_port

pytestmark = pytest.mark.slow  # every test here starts processes (see conftest: tiers)

TRAIN = ["model=gpt_tiny", "model.bias=false", "data=text", "data.micro_batch=4", "trainer.max_steps=6",
         "trainer.eval_every=0", "logging.wandb.mode=disabled", "logging.progress=false"]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    run = tmp_path_factory.mktemp("one_node") / "run"
    run_train(run, 2, *TRAIN)
    return run


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_two_agents_on_loopback_match_one_node(tmp_path, one_node, backend):
    run, port = tmp_path / "run", free_port()
    if backend == "static":  # node 0 hosts the store; ranks follow --node_rank
        rdzv = ["--rdzv_backend=static", "--master_addr=127.0.0.1", f"--master_port={port}"]
    else:  # what slurm.sbatch uses: the agent at the endpoint hosts the c10d store
        rdzv = ["--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=loopback"]
    agents = []
    for node in (0, 1):
        cmd = [*TORCHRUN, "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1", *rdzv, "--max_restarts=0",
               str(ROOT / "train.py"), f"run.dir={run}", *TRAIN]
        agents.append(subprocess.Popen(cmd, cwd=ROOT, env=base_env(), stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=300)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    for node, (agent, out) in enumerate(zip(agents, outputs)):
        assert agent.returncode == 0, f"agent {node} failed ({agent.returncode}):\n{out[-5000:]}"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and read_metrics(run)[-1]["step"] == 6
    # The same two ranks with the same data and kernels, rendezvousing another way: the same sums in
    # the same order, so the same weights bit for bit.
    assert_same_weights(load_weights(run), load_weights(one_node), "two agents vs one node")


def test_torchrun_sh_logs_each_rank_and_status(tmp_path, one_node):
    run = tmp_path / "run"
    proc = run_process([str(ROOT / "launch" / "torchrun.sh"), *TRAIN, f"run.dir={run}"], cwd=tmp_path,
                       env=base_env(NPROC="2"), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (run / "status").read_text().strip() == "completed"
    assert "[default0]:" in proc.stdout + proc.stderr  # --tee: ranks also print to the console
    for r in (0, 1):
        assert (run / "logs" / f"rank{r}.err").exists() and (run / "logs" / f"rank{r}.out").exists()
    assert "run dir" in (run / "logs" / "rank0.out").read_text() + (run / "logs" / "rank0.err").read_text()
    assert_same_weights(load_weights(run), load_weights(one_node), "launch/torchrun.sh vs plain ranks")


def test_torchrun_sh_rejects_bad_override_before_starting_ranks(tmp_path):
    proc = run_process([str(ROOT / "launch" / "torchrun.sh"), "strategy=nope", f"run.root={tmp_path}"],
                       cwd=tmp_path, env=base_env(NPROC="2"), timeout=120)
    assert proc.returncode == 2 and "strategy" in proc.stderr and "ddp" in proc.stderr, proc.stderr
    assert not list(tmp_path.rglob("status"))


def test_torchrun_sh_refuses_a_stop_budget_that_is_not_whole_seconds(tmp_path):
    """ZEROLAB_STOP_S becomes torchrun's --shutdown-timeout (an int): anything else stops the script
    with exit 2, naming the variable, before a run directory or a rank exists."""
    proc = run_process([str(ROOT / "launch" / "torchrun.sh"), f"run.root={tmp_path}"], cwd=tmp_path,
                       env=base_env(NPROC="2", ZEROLAB_STOP_S="5m"), timeout=60)
    assert proc.returncode == 2 and "ZEROLAB_STOP_S must be whole seconds, not '5m'" in proc.stderr, proc.stderr
    assert not list(tmp_path.iterdir())
