"""`python -m recsys.train`: train DLRM from Hydra configs on N ranks.

An entry module only: the command is `recsys.app.train` (the app layer, above this package; this
module is never imported, so the layers keep one direction, tests/unit/test_layers.py).
"""

if __name__ == "__main__":
    from recsys.app.train import cli

    cli(serve_forks=True)  # its ranks start from the stack this process imported
