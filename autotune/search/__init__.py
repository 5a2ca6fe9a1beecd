"""The search's own state and rules: the run directory (rundir) and the Optuna study's storage
(study_storage), which configs not to run (pruning), when the search is done (convergence), the re-runs of
close calls (confirm), and sweep files of many workloads (sweeps). The strategies that propose
(autotune.strategies) and the loop that runs them (autotune.drivers) are folders beside this one."""
