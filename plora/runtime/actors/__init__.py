"""The Ray side of the runtime: the actors and the loop that drives them; they only forward.

:class:`~.dispatch.Dispatcher` (the driver's Ray loop), :class:`~.group.WorkerGroup` (a
resident group: a placement group of d GPU bundles), :class:`~.worker.PackWorker` (one per GPU,
holding the engine), :class:`~.relay.CoordinatorActor` (reports in, control out),
:class:`~.tune_service.TuneService` (a sweep behind Ray Tune's proxy trials), and
:mod:`~.cluster` / :mod:`~.reaper` (connecting to Ray, no orphan processes). The decisions are
the coordinator's (:mod:`plora.runtime.coordinator`, no Ray). ARCHITECTURE.md follows a job
through them ("A job's life"). Submodules import Ray; this package imports none of them.
"""
