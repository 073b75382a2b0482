"""How the model is spread over devices, without changing it: the mesh and its one table from
logical axes to mesh axes (``mesh``), and pipeline stages that wrap the blocks (``pipeline``)."""
