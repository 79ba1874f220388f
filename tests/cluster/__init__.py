"""The test harness's emulated machines, in one home: :mod:`tests.cluster.netns` (hosts as network
namespaces, root only), :mod:`tests.cluster.links` (their links' bandwidth, latency and loss) and
:mod:`tests.cluster.slurm` (a real SLURM on them, the ``slurm_cluster`` fixture). The benchmarks
that need a cluster import it from here; nothing in the ``hpcfl`` package does."""
