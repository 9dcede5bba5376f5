"""`python -m sharding.predict`: predict the step time and memory of a saved plan layout.

An entry module only: the command is `recsys.app.predict` (the app layer, above this package; this
module is never imported, so the layers keep one direction, tests/unit/test_layers.py).
"""

if __name__ == "__main__":
    from recsys.app.predict import main

    main()
