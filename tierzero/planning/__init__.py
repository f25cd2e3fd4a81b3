"""What to store where, decided before anything runs: the ledger, the workload, the memory model,
placement, the swap plan, the machine probe, the disk benchmark and the plan report
(`tierzero.plan`)."""
