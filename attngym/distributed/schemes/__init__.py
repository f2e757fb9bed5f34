"""The CP schemes, one module each, and the table the run layer reads (TopologySpec,
TOPOLOGIES)."""
