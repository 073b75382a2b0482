"""Models in and out: the Hugging Face map both directions read (``hf``: export and
``model.init_from``), ``export`` (``python -m maxfp4.export``), ``sample``
(``python -m maxfp4.sample``) and the KV-cache decoding it runs (``decode``)."""
