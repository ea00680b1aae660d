"""Nodes (zerolab/topology.py): the layout of ranks in nodes, the link a collective's bytes travel
on, and the comm counter's split of them (zerolab/comm.py)."""
import pytest

from zerolab.comm import CommCounter
from zerolab.config import compose
from zerolab.errors import ConfigError
from zerolab.topology import ACROSS, INSIDE, Topology, launcher_ranks_per_node, topology_for


def test_ranks_are_laid_out_node_major():
    t = Topology(world=6, per_node=2)
    assert t.nodes == 3 and [t.node_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [t.local_of(r) for r in range(6)] == [0, 1, 0, 1, 0, 1]
    assert t.node_ranks(1) == [2, 3] and t.cross_ranks(1) == [1, 3, 5]
    assert t.link([2, 3]) == INSIDE and t.link([1, 3, 5]) == ACROSS and t.link(range(6)) == ACROSS


def test_a_layout_that_does_not_divide_the_world_is_refused_with_a_divisor():
    with pytest.raises(ConfigError, match=r"dist.ranks_per_node=3 does not divide the world size 4: .*\(e.g. 2\)"):
        Topology(world=4, per_node=3)
    with pytest.raises(ConfigError, match="dist.ranks_per_node=3 does not divide the world size 4"):
        compose(["dist.ranks_per_node=3"], world_size=4)
    assert compose(["dist.ranks_per_node=2"], world_size=4).dist.ranks_per_node == 2


def test_the_launcher_says_how_many_ranks_a_node_holds():
    assert launcher_ranks_per_node(16, {"LOCAL_WORLD_SIZE": "8"}) == 8  # torchrun --nproc_per_node=8
    assert launcher_ranks_per_node(8, {"SLURM_TASKS_PER_NODE": "4(x2)"}) == 4  # srun, 4 tasks on each of 2 nodes
    assert launcher_ranks_per_node(8, {}) == 8  # no launcher: one node
    assert topology_for(2, 4, {"LOCAL_WORLD_SIZE": "4"}).per_node == 2  # dist.ranks_per_node wins


def test_the_counter_splits_bytes_by_link():
    """4 ranks as 2 nodes x 2: an all-gather over a node's group stays inside, one over every rank
    (or over the ranks sharing a local index) crosses; the ring's (n-1)/n of each group's size."""
    counter = CommCounter(Topology(world=4, per_node=2))
    counter.record("all_gather", 1000, 4, ranks=[0, 1])  # 4000 B over 2 ranks: 2000 B sent
    counter.record("reduce_scatter", 1000, 4)  # every rank: 3000 B
    counter.record("all_reduce", 1000, 4, ranks=[0, 2])  # across nodes: 2 · 4000 / 2
    step = counter.pop_step()
    assert step == {"all_gather": 2000.0, "reduce_scatter": 3000.0, "all_reduce": 4000.0, "total": 9000.0,
                    "link/inside": 2000.0, "link/across": 7000.0}
    one_node = CommCounter(Topology(world=4, per_node=4))
    one_node.record("all_reduce", 10, 4)
    assert "link/across" not in one_node.pop_step()  # a one-node job has one kind of link


@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce"])
@pytest.mark.parametrize("n, per_node", [(2, 2), (3, 3), (8, 8), (8, 4)])
def test_the_counter_and_the_time_model_read_one_volume_table(kind, n, per_node):
    """zerolab.comm.VOLUMES is the one table: the counter records its `sent`, the time model puts its
    `busiest` on the links (inside and across nodes together), and the two agree for every kind
    but the rooted ones, where NCCL's bus bandwidth has the whole buffer on a link
    (busBw = algBw) while the ranks send (n-1)/n of it on average (VOLUMES says why)."""
    from zerolab.comm import VOLUMES
    from zerolab.predict.hardware import DEVICES, LINKS
    from zerolab.predict.topology import Network

    S = 3 << 30  # large enough that NCCL's tuner picks the ring for an all-reduce across nodes, not the tree
    counter = CommCounter(Topology(world=n, per_node=per_node))
    counter.record(kind, S, 1)
    sent = counter.pop_step()[kind]
    network = Network(n, per_node, LINKS["nvlink4"], LINKS["ib-ndr"], DEVICES["h100"])
    priced = network.price(kind, S, tuple(range(n)))
    assert priced.algorithm == ("pairwise" if kind == "all_to_all" else "ring")
    on_links = priced.intra_bytes + priced.inter_bytes
    volume = VOLUMES[kind]
    assert sent == volume.sent(S, n) == S * (2 if kind == "all_reduce" else 1) * (n - 1) / n
    assert on_links == pytest.approx(volume.busiest(S, n), rel=1e-12)
    if volume.rooted:
        assert on_links == S and sent == S * (n - 1) / n
    else:
        assert on_links == pytest.approx(sent, rel=1e-12)


def test_one_topology_lays_out_the_ranks_for_the_counter_and_the_time_model():
    """zerolab.topology.Topology is the one class that says which node a rank is on: the time
    model's Network holds one (a world smaller than a node fills part of one node)."""
    import ast

    from conftest import ROOT
    from zerolab.predict.hardware import DEVICES, LINKS
    from zerolab.predict.topology import Network

    classes = [f"{p.relative_to(ROOT)}" for p in (ROOT / "zerolab").rglob("*.py")
               for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ClassDef) and n.name == "Topology"]
    assert classes == ["zerolab/topology.py"]
    net = Network(16, 8, LINKS["nvlink4"], LINKS["ib-ndr"], DEVICES["h100"])
    assert net.layout == Topology(world=16, per_node=8) and net.nodes == 2
    assert net.placement(tuple(net.layout.cross_ranks(3))) == (2, 2, 1)
    assert Network(2, 8, LINKS["nvlink4"], LINKS["ib-ndr"], DEVICES["h100"]).layout == Topology(world=2, per_node=2)
