"""Starting and keeping the ranks: one process per rank, the keep-alive."""
