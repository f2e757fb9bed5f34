"""Where the sequence lies: layouts (balancers), the block grid, global positions."""
