"""Running a job: the train, dpo and sft runners, the run directory and its store, leases,
interrupts, checkpoints, metric sinks, plots, evaluation and the demo."""
