"""Memory real kernels allocate where a fake tensor cannot see it: per-op rules (scratch, output
layouts) and the CPU kernel probe, which measures the rest per shape (budgeted by work, never by
wall time)."""
