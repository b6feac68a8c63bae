"""The registry of step stages users add from their own modules (``algorithm.stages``).

A stage is an object (a subclass of :class:`postrl.controller.stages.Stage`); what is registered is
its factory, called once per run as ``factory(context, **options)`` with a
:class:`postrl.controller.stages.StageContext`. Register it in a module listed in
``algorithm.plugins``::

    @register_stage("length_stats")
    class LengthStats(Stage):
        ...
"""

from __future__ import annotations

from postrl.algorithms.registry import Registry

STAGES: Registry = Registry("stage")
register_stage = STAGES.register
