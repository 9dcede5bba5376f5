"""`python -m sharding.describe output=<dir>/cluster/<name>.yaml`: this machine as a cluster
file (CPU ranks, or its GPUs with the GPU probe's figures). An entry module only: the
command is `recsys.app.describe`."""

if __name__ == "__main__":
    from recsys.app.describe import main

    main()
