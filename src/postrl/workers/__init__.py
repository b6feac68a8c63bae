"""How any role is called, wherever it lives: the role Protocols, clients made from them, handles,
child processes, the wire format, HTTP guards and network helpers. A leaf: of postrl it imports
only ``types``."""

from postrl.workers.handles import Handle, InProcessHandle, WorkerDiedError, WorkerTimeoutError, gather

__all__ = ["Handle", "InProcessHandle", "WorkerDiedError", "WorkerTimeoutError", "gather"]
