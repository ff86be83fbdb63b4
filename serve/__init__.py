"""specdec.serve: an OpenAI-compatible HTTP server over the batched engine (``specdec serve``).

Needs the ``serve`` extra: ``pip install 'specdec[serve]'`` (FastAPI, uvicorn, prometheus_client,
Jinja2). ``app`` builds the routes, ``server`` runs them, ``protocol`` and ``validation`` check request bodies,
``metrics`` exports Prometheus metrics, ``chat`` renders chat templates, ``stops`` handles stop
strings.
"""
