"""`python -m sharding.plan`: plan a config's tables and write the plan and its report.

An entry module only: the command is `recsys.app.plan` (the app layer, above this package; this
module is never imported, so the layers keep one direction, tests/unit/test_layers.py).
"""

if __name__ == "__main__":
    from recsys.app.plan import main

    main()
