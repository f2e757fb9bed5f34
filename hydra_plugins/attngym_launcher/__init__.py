"""attngym's Hydra launcher plugin: Hydra instantiates launchers only from the `hydra_plugins`
namespace, so the class that conf/hydra/launcher/submitit_slurm.yaml names lives here; what it
does is attngym.slurm's. Without hydra-submitit-launcher (the `slurm` extra) there is nothing to
define, and Hydra's plugin scan must not fail on that."""

try:
    from attngym.slurm import AttngymSlurmLauncher
except ImportError:  # hydra-submitit-launcher is not installed: no SLURM launcher
    AttngymSlurmLauncher = None

if AttngymSlurmLauncher is not None:

    class SlurmLauncher(AttngymSlurmLauncher):
        """attngym.slurm.AttngymSlurmLauncher, where Hydra's plugin rules want it."""
