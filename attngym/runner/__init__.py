"""The run layer: a run from the command line, a notebook or a launcher (Hydra, the
tasks, tracking, pictures); the library under attngym/ never imports it."""
