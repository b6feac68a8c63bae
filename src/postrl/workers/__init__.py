"""How any role is called, wherever it lives: handles, child processes, the wire format, HTTP
guards and network helpers. A leaf: it imports no other postrl package."""

from postrl.workers.handles import Handle, InProcessHandle, WorkerDiedError, WorkerTimeoutError, gather

__all__ = ["Handle", "InProcessHandle", "WorkerDiedError", "WorkerTimeoutError", "gather"]
