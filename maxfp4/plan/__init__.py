"""The planner: a run's memory, step time and days on a mesh of GPUs, before it starts.

``cost`` is the cost model (parameters, FLOPs, memory, communication, compute, from
:mod:`maxfp4.model_spec`) at the rates of ``rates``, ``stages`` the pipeline's schedule and
stage cut, ``layout`` chooses the batch and mesh (pipeline stages included), ``command`` is
``python -m maxfp4.plan``. Every formula and constant is stated in docs/PLANNING.md.
"""
