"""`python -m sharding.profile`: measure a dataset's access profile for the planners.

An entry module only: the command is `recsys.app.profile` (the app layer, above this package; this
module is never imported, so the layers keep one direction, tests/unit/test_layers.py).
"""

if __name__ == "__main__":
    from recsys.app.profile import main

    main()
