"""`python -m attngym [overrides]` and `python -m attngym report DIR`: the same as `attngym`."""

from attngym.runner.cli import entry

if __name__ == "__main__":
    entry()
