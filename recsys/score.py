"""`python -m recsys.score export=<export dir> input=<prepared dir | Criteo text> output=<file>`:
score every sample of a file with a model `python -m recsys.export` wrote (one process, no
TorchRec sharding); see recsys/export.py. An entry module only."""

if __name__ == "__main__":
    from recsys.export import score_main

    score_main()
