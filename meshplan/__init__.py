"""meshplan's Python API: the functions a user calls from their own code (the CLI is `cli.py`).

    import meshplan
    meshplan.export(module, (ids,), "model.onnx", dynamic=[("batch", "seq")])   # then `meshplan plan`

Importing this package imports no torch; the functions import it when called.
"""

from planner.export import export, export_config, export_hf_config

__all__ = ["export", "export_config", "export_hf_config"]
