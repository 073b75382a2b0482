"""The planner: a run's memory, step time and days on a mesh of GPUs, before it starts.

``cost`` is the cost model (parameters, FLOPs, memory, communication, compute, from
:mod:`maxfp4.model_spec`) at the rates of ``rates``, ``stages`` the mesh it prices, ``layout``
chooses the batch and mesh (pipeline stages included: the trainer's schedule, cut and rules, from
:mod:`maxfp4.parallel.pipeline_schedule` and :mod:`maxfp4.parallel.pipeline_stages`),
``command`` is ``python -m maxfp4.plan``. Every formula and constant is stated in docs/PLANNING.md.
"""
