"""The ``hidden-state demo``: a tiny model, bundled prompts, a live server and a trainer."""
