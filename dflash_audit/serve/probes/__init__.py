"""Scripts that run in an engine's (or the reference's) process and write a
:class:`~dflash_audit.serve.fields.SideRecord` as ``probe.json``.

Each is started as ``python PROBE CHECKPOINT_DIR OUT_JSON`` with the engine's cached site
folder and this project's root on ``PYTHONPATH``; it imports the engine, torch, transformers
and :mod:`dflash_audit.serve.fields` / :mod:`.engine_source` only.
"""
