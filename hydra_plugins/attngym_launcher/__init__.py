"""attngym's Hydra launcher plugins: Hydra instantiates launchers only from the `hydra_plugins`
namespace, so the classes that conf/hydra/launcher/*.yaml name live here; what they do is
attngym.runner.launchers.basic's (the default, jobs on this machine) and
attngym.runner.launchers.slurm's. Without hydra-submitit-launcher (the `slurm` extra) there is no
SLURM launcher to define, and Hydra's plugin scan must not fail on that."""

from attngym.runner.launchers.basic import AttngymBasicLauncher

try:
    from attngym.runner.launchers.slurm import AttngymSlurmLauncher
except ImportError:  # hydra-submitit-launcher is not installed: no SLURM launcher
    AttngymSlurmLauncher = None


class BasicLauncher(AttngymBasicLauncher):
    """attngym.runner.launchers.basic.AttngymBasicLauncher, where Hydra's plugin rules want it."""


if AttngymSlurmLauncher is not None:

    class SlurmLauncher(AttngymSlurmLauncher):
        """attngym.runner.launchers.slurm.AttngymSlurmLauncher, where Hydra's plugin rules want
        it."""
