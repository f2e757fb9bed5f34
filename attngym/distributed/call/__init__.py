"""What every scheme's call is made of: one q chunk over one kv chunk, the lse merge and
the accumulators, the flex backward op."""
