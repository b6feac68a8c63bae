"""Placing the workers: in this process, in child processes, or as Ray actors, behind one handle type."""

from postrl.scheduling.handles import Handle, InProcessHandle, WorkerDiedError, WorkerTimeoutError, gather

__all__ = ["Handle", "InProcessHandle", "WorkerDiedError", "WorkerTimeoutError", "gather"]
