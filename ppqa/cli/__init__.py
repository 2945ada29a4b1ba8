"""ppqa's command line: a Typer app (`app.py`) with one module per command group.

Commands are thin: they check input, call the store (or, for `run`, the worker) and render the
result with `render.py`. Only commands that run a model import torch, inside their function.
"""
