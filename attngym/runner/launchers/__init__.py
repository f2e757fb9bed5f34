"""Where a sweep's jobs run: this machine (basic) or SLURM (submitit)."""
