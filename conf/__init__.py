"""attngym's Hydra configs, installed as the package `attngym.conf` (read as pkg://attngym.conf)."""
