"""Where the workers live: in this process, in child processes, or as Ray actors."""
